"""Offline throughput: nano-vllm's benchmark method, scaled to a CPU.

N requests (default 64) of random token ids, prompts of 32–512 tokens, 32–256 new tokens each,
ignore_eos, seed 0. Prints output tokens/s for kvserve and, with ``--peer hf``, for Hugging Face
transformers on the same requests in the same run, and the ratio.

    python -m kvserve.benchmarks.offline [--num-requests 64] [--peer hf] [--peer-batch 16]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from kvserve.benchmarks.peers import load_transformers_model
from kvserve.engine import LLM, SamplingParams


def make_requests(n: int, prompt_range, output_range, seed: int, vocab: int = 10000):
    """Random prompt ids below ``vocab`` (nano-vllm draws below 10,000) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def active_parameters(hf_config) -> tuple[int, int]:
    """(all, active per token) matmul weights: a token of a mixture of experts runs ``top_k`` of
    ``num_experts`` experts. The embedding is a lookup, so it counts only as the LM head."""
    from kvserve.engine.models import checkpoint_shapes

    share = getattr(hf_config, "num_experts_per_tok", 1) / (getattr(hf_config, "num_experts", 1) or 1)
    total = active = hf_config.vocab_size * hf_config.hidden_size if hf_config.tie_word_embeddings else 0
    for name, shape in checkpoint_shapes(hf_config).items():
        if name.endswith("embed_tokens.weight"):
            continue
        total += math.prod(shape)
        active += math.prod(shape) * (share if ".experts." in name else 1)
    return total, int(active)


def run_kvserve(llm: LLM, args, prompts, outputs) -> float:
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=args.temperature, max_tokens=m, ignore_eos=True) for m in outputs]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - t0
    assert sum(len(r.token_ids) for r in results) == sum(outputs)
    return elapsed


def load_hf_peer(llm: LLM):
    """transformers' model on the same weights, dtype and device as kvserve."""
    ex = llm.engine.executor
    return load_transformers_model(llm.engine.source, ex.dtype, ex.device)


def run_hf(model, prompts, outputs, batch: int) -> float:
    """transformers ``generate``: padded batches (left padding), grouped by output length."""
    order = sorted(range(len(prompts)), key=lambda i: outputs[i])
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            idx = order[s : s + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            new = max(outputs[i] for i in idx)
            model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - t0


def run_hf_continuous(model, prompts, outputs) -> float:
    """transformers' continuous batching (the engine behind ``generate_batch``), each request
    with its own number of new tokens and no EOS."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode(), model.continuous_batching_context_manager(generation_config=config) as mgr:
        for i, (p, m) in enumerate(zip(prompts, outputs, strict=True)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
        done = 0
        while done < len(prompts):
            result = mgr.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
            elif result is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--peer",
        choices=["none", "hf", "hf-batch"],
        default="none",
        help="hf: transformers generate in padded batches; hf-batch: transformers continuous batching",
    )
    ap.add_argument("--peer-batch", type=int, default=16, help="transformers batch size (padded)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    prompts, outputs = make_requests(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        args.seed,
        vocab=min(10000, llm.engine.vocab_size),
    )
    total = sum(outputs)
    elapsed = run_kvserve(llm, args, prompts, outputs)
    ours = total / elapsed
    print(f"requests={args.num_requests} prompt_tokens={sum(map(len, prompts))} output_tokens={total}")
    total_params, active = active_parameters(llm.engine.executor.hf_config)
    tokens = sum(map(len, prompts)) + total
    print(f"matmul weights {total_params / 1e6:.1f}M, {active / 1e6:.1f}M active per token: "
          f"{2 * active / 1e6:.1f} MFLOP/token, kvserve {2 * active * tokens / elapsed / 1e9:.1f} GFLOP/s")
    print(f"kvserve      {elapsed:8.2f} s  {ours:8.1f} output tok/s  ({llm.stats()['dtype']})")
    if args.peer != "none":
        model = load_hf_peer(llm)
        if args.peer == "hf":
            hf_elapsed, mode = (
                run_hf(model, prompts, outputs, args.peer_batch),
                f"generate, batches of {args.peer_batch}",
            )
        else:
            hf_elapsed, mode = run_hf_continuous(model, prompts, outputs), "continuous batching"
        peer = total / hf_elapsed
        print(f"transformers {hf_elapsed:8.2f} s  {peer:8.1f} output tok/s  ({mode})")
        print(f"ratio kvserve / transformers = {ours / peer:.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
