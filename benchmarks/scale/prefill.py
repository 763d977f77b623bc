"""A prefill chunk through a GGUF model of a real shape, with the int8 GEMM for its K-quant
projections (csrc/kquant_gemm.c) and without (dequantized bfloat16 panels into the float GEMM on
AVX512-BF16 CPUs, the block dots elsewhere), in one process, the two taking turns round by round
(``python -m kvserve.benchmarks.scale.prefill``): milliseconds per prefill of ``--tokens`` tokens
(best round of each) and their ratio. The file: SmolLM2-1.7B's layer shape (hidden 2048, 32 heads,
intermediate 8192) in llama-quantize's Q4_K_M mix (Q6_K v and down, Q4_K elsewhere), random valid
blocks, ``--layers`` of them (the whole model's prefill is that per layer times 24, plus attention
and the rest), a small vocabulary (a prefill computes one row of logits). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.benchmarks.scale.kernels import random_weight

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 8192, 32, 32, 4096
Q4_K, Q6_K = 12, 14
# each projection's type and its rows: per query head ("q"), per key-value head ("kv"), else MLP
PARTS = {"attn_q": (Q4_K, "q"), "attn_k": (Q4_K, "kv"), "attn_v": (Q6_K, "kv"), "attn_output": (Q4_K, "q"),
         "ffn_gate": (Q4_K, None), "ffn_up": (Q4_K, None), "ffn_down": (Q6_K, None)}


def write_model(path: Path, layers: int, context: int, hidden: int = HIDDEN, inter: int = INTER,
                heads: int = HEADS, kv_heads: int = KV_HEADS, vocab: int = VOCAB) -> None:
    """A llama GGUF file in llama-quantize's Q4_K_M types (Q6_K v, down and the tied table, Q4_K
    elsewhere, float32 norms), random valid blocks: SmolLM2-1.7B's layer shape unless told."""
    from gguf import GGUFWriter

    head_dim = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, context),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_vocab_size, vocab)):
        add(value)
    writer.add_tensor("token_embd.weight", random_weight(Q6_K, vocab, hidden, 0).numpy(), raw_dtype=Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for j, (part, (qtype, per_head)) in enumerate(PARTS.items()):
            rows = (heads if per_head == "q" else kv_heads) * head_dim if per_head else (
                hidden if part == "ffn_down" else inter)
            data = random_weight(qtype, rows, inter if part == "ffn_down" else hidden, 1 + 10 * i + j).numpy()
            writer.add_tensor(f"blk.{i}.{part}.weight", data, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.layers import gguf_linear
    from kvserve.engine.model_input import ModelInput
    from kvserve.engine.runner.model_runner import ModelRunner

    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.prefill",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    block = 16
    blocks = -(-args.tokens // block)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm2-1.7b-shape-q4_k_m.gguf"
        write_model(path, args.layers, max(256, args.tokens))
        runner = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=blocks,
                                          block_size=block, enforce_eager=True))
        n = args.tokens
        prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        step = ModelInput(input_ids=prompt, positions=list(range(n)), query_lens=[n], context_lens=[n],
                          block_tables=[list(range(blocks))], slot_mapping=list(range(n)),
                          logits_indices=[n - 1])
        with_gemm = gguf_linear.gemm_takes

        def without(kernels, part):
            return False

        paths = {"int8 GEMM": with_gemm, "without": without}
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, takes in paths.items():
                gguf_linear.gemm_takes = takes
                start = time.perf_counter()
                runner.execute_model(step)
                best[name] = min(best[name], time.perf_counter() - start)
        gguf_linear.gemm_takes = with_gemm
    print(f"prefill of {n} tokens, {args.layers} layers of SmolLM2-1.7B's shape (Q4_K_M mix), "
          f"{torch.get_num_threads()} threads, best of {args.rounds} interleaved rounds:")
    for name, t in best.items():
        print(f"  {name}: {t * 1e3:9.1f} ms ({n / t:7.1f} tokens/s)")
    print(f"  int8 GEMM: {best['without'] / best['int8 GEMM']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
