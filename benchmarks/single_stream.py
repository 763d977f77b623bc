"""One stream: output tokens/s with one request at a time, and what int8 weights cost in accuracy.

For each ``--quantization`` variant (``none`` = the serving dtype's weights), in one run: requests
of random prompt ids run one at a time (``max_num_seqs=1``), as llama.cpp's single-stream figure
is measured; then greedy continuations of the parity prompts of ``tests/test_engine.py`` are
compared with the first variant's: how many tokens agree before the first difference.

    python -m kvserve.benchmarks.single_stream [--variants none int8] [--num-requests 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve.benchmarks.offline import make_requests
from kvserve.engine import LLM, SamplingParams

PARITY_PROMPTS = [
    "Hello",
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    " ".join(f"Paragraph {i}: the river carried boats of grain, salt and timber to the markets of the coast."
             for i in range(20)),
    "Translate to French: I like apples.\nFrench:",
    "What is the capital of France?",
]


def measure(variant: str, args) -> dict:
    options = {} if variant == "none" else {"quantization": variant}
    if args.threads:
        options["threads"] = args.threads
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, **options)
    try:
        prompts, outputs = make_requests(args.num_requests, (32, 128), (args.new_tokens, args.new_tokens),
                                         args.seed, vocab=min(10000, llm.engine.vocab_size))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0, max_tokens=args.parity_tokens, ignore_eos=True)
        parity = [r.token_ids for r in llm.generate(PARITY_PROMPTS, greedy, use_tqdm=False)]
        dtype = str(llm.engine.executor.dtype).removeprefix("torch.")
    finally:
        llm.shutdown()
    return {"variant": variant, "dtype": dtype, "output_tok_s": sum(outputs) / seconds, "parity": parity,
            "threads": torch.get_num_threads()}


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of the reference's tokens that the other run repeats before its first difference."""
    agreed = 0
    for ref, out in zip(reference, other, strict=True):
        for a, b in zip(ref, out, strict=False):
            if a != b:
                break
            agreed += 1
    return agreed / sum(len(r) for r in reference)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--variants", nargs="+", default=["none", "int8"], help="'none' and/or quantizations")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = [measure(v, args) for v in args.variants]
    reference = results[0]
    for r in results:
        r["greedy_agreement"] = agreement(reference["parity"], r["parity"])
        print(f"{r['variant']:>6} ({r['dtype']}, {r['threads']} threads): {r['output_tok_s']:7.1f} output "
              f"tok/s one request at a time; greedy agreement with {reference['variant']}: "
              f"{r['greedy_agreement']:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
