"""A Hugging Face model directory with seeded random weights, built from a config alone, so
GPU checks and benchmarks run with nothing but the repository (no download, no GGUF).

It holds ``config.json``, ``model.safetensors`` (``random_weights`` of the engine's model
registry, checkpoint names) and a word-level tokenizer whose tokens are ``<t0>``, ``<t1>``, ...
Both kvserve (``LLM(model=DIR)``) and transformers (``from_pretrained(DIR)``) load it.

    python -m kvserve.testing.random_model qwen3-0.6b /tmp/qwen3-0.6b-random
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# name -> (architecture, config fields); qwen3-0.6b follows Qwen/Qwen3-0.6B's config.json. The tiny
# shapes keep a vocabulary above 10,000: the offline benchmark draws prompt ids below that.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
    )),
    "qwen3-tiny": ("Qwen3ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
    )),
    "llama-tiny": ("LlamaForCausalLM", dict(
        vocab_size=10240, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    )),
    # mixtures of experts: 8 experts, top-2 (Qwen3-MoE renormalises only with norm_topk_prob)
    "qwen3-moe-tiny": ("Qwen3MoeForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
    )),
    "qwen2-moe-tiny": ("Qwen2MoeForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )),
    "mixtral-tiny": ("MixtralForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        sliding_window=None, tie_word_embeddings=False,
    )),
    # Qwen3-30B-A3B's proportions (128 experts, top-8, 32 q / 4 kv heads of 128) scaled down to fit a
    # laptop: 64 experts, top-8, 8 layers; 189M parameters, 57M active per token (33M of them embeddings)
    "qwen3-moe-small": ("Qwen3MoeForCausalLM", dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=False,
    )),
    # the sizes CPU users serve from GGUF (``make bench-scale``), after each model's config.json; Llama
    # 3.2's rope scaling is left out (a GGUF of it carries rope_freqs, which kvserve's reader refuses)
    "smollm2-1.7b": ("LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=130000.0,
        tie_word_embeddings=True,
    )),
    "llama-3.2-1b": ("LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True,
    )),
    "llama-3.2-3b": ("LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True,
    )),
    "qwen3-1.7b": ("Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True,
    )),
}  # fmt: skip
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe",
               "Qwen2MoeForCausalLM": "qwen2_moe",
               "MixtralForCausalLM": "mixtral"}


def make_config(name: str, **overrides):
    """The transformers config of the shape called ``name``, with ``overrides`` of its fields."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    architecture, fields = SHAPES[name]
    fields = {**fields, **overrides}
    return AutoConfig.for_model(MODEL_TYPES[architecture], architectures=[architecture], **fields)


def write_random_model(name: str, out_dir: str | Path, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the model directory (weights stored in ``dtype``) and return its path."""
    return write_model_dir(make_config(name), out_dir, seed, dtype)


def write_model_dir(config, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A model directory with ``config`` and its seeded random weights (tests vary a named shape)."""
    from safetensors.torch import save_file

    from kvserve.engine.model_loader.checkpoint import random_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weights = {n: t.to(dtype).contiguous() for n, t in random_weights(config, seed)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _word_level_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def _word_level_tokenizer(vocab_size: int):
    """A tokenizer with one whitespace-separated word per id: ids round-trip through text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<t0>")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)
    path = write_random_model(args.shape, args.out_dir, args.seed, getattr(torch, args.dtype))
    print(path)


if __name__ == "__main__":
    main()
