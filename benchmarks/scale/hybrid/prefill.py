"""A linear-attention hybrid's prefill in process (``python -m kvserve.benchmarks.scale.hybrid.prefill
--model DIR``; a Qwen3.5 checkpoint, e.g. the scale harness's qwen3.5-2b): prompt tokens per second
of fresh prompts of ``--prompt`` tokens through ``LLM.generate`` (one output token each), per arm,
the arms taking turns round by round in one engine, so that on a shared machine they see the same
load:

- ``--chunks``: the token budget of a step (prefill chunk size); the served engine's default
  500 ms step bound (``--max-step-time-ms``) cuts a 2B model's chunks to a few dozen tokens;
- with ``--norm-ab``, each chunk size also with the Gated DeltaNet layers' gated norm in its torch
  form (``GatedDeltaNet._gated_norm``) instead of csrc/gated_delta.c's ``gdn_gated_norm``.

Each arm's figure is its best round; the rounds are printed too. No step bound in process
(``max_step_time_ms=0``): the chunk is the budget.
"""

from __future__ import annotations

import argparse
import time

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.engine_steps import random_prompts
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.qwen3_5 import GatedDeltaNet


def torch_norm(layer: GatedDeltaNet, out, z, mixed):
    """``GatedDeltaNet._normed`` with the C kernel left out (its torch form)."""
    normed = layer._gated_norm(out.to(z.dtype), z.reshape(-1, layer.num_v_heads, layer.v_dim))
    return normed.reshape(z.shape[0], -1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.hybrid.prefill",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Qwen3.5 (or Qwen3-Next) checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per round and arm")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512], help="step token budgets to compare")
    ap.add_argument("--norm-ab", action="store_true", help="also each chunk size with the torch gated norm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(1, args.prompts),
              max_num_batched_tokens=max(args.chunks), max_step_time_ms=0, enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    if not any(isinstance(m, GatedDeltaNet) for m in llm.engine.executor.model.modules()):
        raise SystemExit(f"{args.model} has no Gated DeltaNet layers")
    arms = [(chunk, norm) for chunk in args.chunks for norm in (("C", "torch") if args.norm_ab else ("C",))]
    params = SamplingParams(temperature=0, max_tokens=1)
    rates: dict[tuple[int, str], list[float]] = {arm: [] for arm in arms}
    try:
        llm.generate(random_prompts(1, 64, 10000, 0), params, use_tqdm=False)  # warm-up
        seed = 1
        for r in range(args.rounds):
            for chunk, norm in arms if r % 2 == 0 else arms[::-1]:
                scheduler.max_num_batched_tokens = chunk
                GatedDeltaNet._normed = torch_norm if norm == "torch" else NORMED
                prompts = random_prompts(args.prompts, args.prompt, 10000, seed)  # nothing cached
                seed += 1
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[(chunk, norm)].append(args.prompts * args.prompt / (time.perf_counter() - t0))
    finally:
        GatedDeltaNet._normed = NORMED
        llm.shutdown()
    figures = {"model": args.model, "prompt": args.prompt, "prompts": args.prompts, "arms": []}
    base = max(rates[arms[0]])
    for (chunk, norm), got in rates.items():
        figures["arms"].append({"chunk": chunk, "norm": norm, "tok_s": max(got), "rounds": got})
        print(f"chunk {chunk:>5}, gated norm {norm:>5}: {max(got):8.1f} prompt tok/s (best of "
              f"{', '.join(f'{x:.1f}' for x in got)}), {max(got) / base:.2f}x the first arm", flush=True)
    write_json(args.json, figures)
    return figures


NORMED = GatedDeltaNet._normed

if __name__ == "__main__":
    main()
