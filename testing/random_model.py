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

# the tiny shapes' special ids: families whose config defaults point past a tiny vocabulary
TINY_SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
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
    # sliding-window attention: a window on every layer (Mistral), on layers 0 and 2 of 3 (Ministral)
    "mistral-tiny": ("MistralForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=8,
        tie_word_embeddings=False,
    )),
    "ministral-tiny": ("MinistralForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
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
    # the 2026 families (docs/reference/models.md): each at a tiny shape for tests and at a released
    # model's shape (its config.json) for benchmarks
    "smollm3-tiny": ("SmolLM3ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, no_rope_layer_interval=4,
        tie_word_embeddings=True, **TINY_SPECIAL_IDS,
    )),
    "smollm3-3b": ("SmolLM3ForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536, rope_theta=5_000_000.0,
        no_rope_layer_interval=4, tie_word_embeddings=True,
    )),
    "phi3-tiny": ("Phi3ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, sliding_window=None, tie_word_embeddings=False,
        **TINY_SPECIAL_IDS,
    )),
    # Phi-4-mini's partial rotary (3/4 of each head turns) and LongRoPE, over an original context of
    # 64 tokens that the test prompts stay inside
    "phi4-mini-tiny": ("Phi3ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, sliding_window=None, partial_rotary_factor=0.75,
        original_max_position_embeddings=64, tie_word_embeddings=True, **TINY_SPECIAL_IDS,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [2.0, 2.5, 3.5, 5.0, 7.0, 9.5]},
    )),
    "phi3-mini": ("Phi3ForCausalLM", dict(  # Phi-3-mini-4k-instruct
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        sliding_window=2047, tie_word_embeddings=False,
    )),
    # Gemma: windows of 8 tokens on alternate layers (2) or five layers of six (3), so that test
    # prompts span several windows; soft caps as Gemma 2 ships them
    "gemma2-tiny": ("Gemma2ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=2048,
        tie_word_embeddings=True, **TINY_SPECIAL_IDS,
    )),
    "gemma2-2b": ("Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    )),
    "gemma3-tiny": ("Gemma3ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        max_position_embeddings=2048, tie_word_embeddings=True, **TINY_SPECIAL_IDS,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    )),
    "gemma3-1b": ("Gemma3ForCausalLM", dict(  # the benchmark shape
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    )),
    # gpt-oss: 8-token windows on alternate layers, sinks, 8 experts top-2, YaRN over a short original
    # context so that its ramp lies inside the head
    "gpt-oss-tiny": ("GptOssForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        max_position_embeddings=1024, tie_word_embeddings=False, **TINY_SPECIAL_IDS,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256},
    )),
    "gpt-oss-20b": ("GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    )),
    # Qwen3.5: Gated DeltaNet (linear attention) layers, every fourth layer full attention with a
    # quarter of each head turning; the tiny shape puts linear layers after the full one too
    "qwen3.5-tiny": ("Qwen3_5ForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=2048, tie_word_embeddings=False, **TINY_SPECIAL_IDS,
    )),
    "qwen3.5-0.8b": ("Qwen3_5ForCausalLM", dict(  # Qwen/Qwen3.5-0.8B's text_config
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )),
    "qwen3.5-2b": ("Qwen3_5ForCausalLM", dict(  # Qwen/Qwen3.5-2B's text_config
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )),
    # Qwen3-Next: Qwen3.5's hybrid with mixtures of experts (8 experts, top-2, a shared expert)
    "qwen3-next-tiny": ("Qwen3NextForCausalLM", dict(
        vocab_size=10240, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=64, norm_topk_prob=True, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=2048, tie_word_embeddings=False, **TINY_SPECIAL_IDS,
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
               "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
               "MistralForCausalLM": "mistral", "MinistralForCausalLM": "ministral",
               "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
               "Gemma3ForCausalLM": "gemma3_text", "GptOssForCausalLM": "gpt_oss",
               "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3NextForCausalLM": "qwen3_next"}


# each family's chat format, written for these directories after the released models' own: (jinja
# template, special tokens, plain words the template writes); they take the vocabulary's last ids
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Gemma has no system role: a system message opens the first user turn, as Gemma's template does
GEMMA = ("{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
         "{% if m.role == 'system' %}{% set ns.system = m.content + '\n\n' %}{% else %}"
         "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ ns.system + m.content }}"
         "<end_of_turn>\n{% set ns.system = '' %}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# gpt-oss's harmony: a system message is the developer's instructions; replies go to the final channel
HARMONY = ("{% for m in messages %}{% if m.role == 'system' %}<|start|>developer<|message|># Instructions"
           "\n\n{{ m.content }}<|end|>{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final"
           "<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
           "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ROLES = ["system", "user", "assistant", "tool"]
CHAT_FORMATS = {
    "SmolLM3ForCausalLM": (CHATML, ["<|im_start|>", "<|im_end|>"], ROLES),
    "Phi3ForCausalLM": (PHI3, ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"], []),
    "Gemma2ForCausalLM": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"], ["user", "model", "tool"]),
    "Gemma3ForCausalLM": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"], ["user", "model", "tool"]),
    "GptOssForCausalLM": (HARMONY, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>",
                                    "<|call|>"], [*ROLES, "developer", "final", "#", "Instructions"]),
}


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
    architecture = (config.architectures or [""])[0]
    _word_level_tokenizer(config.vocab_size, CHAT_FORMATS.get(architecture)).save_pretrained(out)
    return out


def _word_level_tokenizer(vocab_size: int, chat: tuple[str, list[str], list[str]] | None = None):
    """A tokenizer with one whitespace-separated word per id: ids round-trip through text. With a
    family's ``chat`` format, its special tokens and words take the last ids (specials split out of
    the text before the words, as in the released tokenizers) and its template renders chats."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, specials, words = chat or (None, [], [])
    vocab = {f"<t{i}>": i for i in range(vocab_size - len(specials) - len(words))}
    vocab.update({token: vocab_size - 1 - i for i, token in enumerate([*specials, *words])})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    extra = {"bos_token": "<bos>"} if "<bos>" in specials else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<t0>", **extra)
    if template:
        fast.chat_template = template
    return fast


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
