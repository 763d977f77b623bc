"""Offline throughput: nano-vllm's benchmark method, scaled to a CPU.

N requests (default 64) of random token ids, prompts of 32–512 tokens, 32–256 new tokens each,
ignore_eos, seed 0. Prints output tokens/s for kvserve; then the machine's ceiling for the same
workload, measured in the same run (``benchmarks/instruments/ceiling.py``: the matmul time of the model's
projections at the batch sizes the workload passes through, and the memory read bandwidth), and
kvserve's share of it; with ``--peer hf`` / ``hf-batch``, Hugging Face transformers on the same
requests, and the ratio. The peer is loaded only once kvserve is shut down and its KV cache freed,
and a peer that fails reports its error next to kvserve's figures. ``--json FILE`` writes them.

    python -m kvserve.benchmarks.offline [--num-requests 64] [--peer hf] [--peer-batch 16] [--json out.json]

``--json-schema FILE`` measures structured output's cost per step instead (benchmarks/structured.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.ceiling import (
    MatmulCeiling,
    ideal_workload_time,
    kv_bytes_per_token,
    memory_bandwidth,
)
from kvserve.benchmarks.peers import load_transformers_model
from kvserve.benchmarks.structured import run_structured_overhead
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import KV_CACHE_DTYPES
from kvserve.engine.model_loader.loader import load_hf_config


def make_requests(n: int, prompt_range, output_range, seed: int, vocab: int = 10000):
    """Random prompt ids below ``vocab`` (nano-vllm draws below 10,000) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def active_parameters(hf_config) -> tuple[int, int]:
    """(all, active per token) matmul weights: a token of a mixture of experts runs ``top_k`` of
    ``num_experts`` experts. The embedding is a lookup, so it counts only as the LM head."""
    from kvserve.engine.model_loader.checkpoint import checkpoint_shapes

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


def parse_args(argv=None) -> argparse.Namespace:
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
    ap.add_argument("--threads", type=int, default=None, help="engine intra-op threads (default: engine's)")
    ap.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                    help="GiB of KV cache on the CPU (default: the engine's)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None, help="engine weight quantization: int8 or int4")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the KV cache: auto = the model's dtype, int8 = int8 rows with scales (CPU)")
    ap.add_argument(
        "--peer",
        choices=["none", "hf", "hf-batch"],
        default="none",
        help="hf: transformers generate in padded batches; hf-batch: transformers continuous batching",
    )
    ap.add_argument("--peer-batch", type=int, default=16, help="transformers batch size (padded)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the machine's ceiling")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="draw kvserve vs the peer vs the ceiling (matplotlib: the plot or dev extra)")
    ap.add_argument("--json-schema", metavar="FILE",
                    help="measure the cost per step of constraining the outputs to this JSON schema")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def engine_options(args) -> dict:
    options = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    if args.threads is not None:
        options["threads"] = args.threads
    if args.quantization is not None:
        options["quantization"] = args.quantization
    options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory
    return options


def run_ours(args) -> dict:
    """kvserve's run; the engine is shut down (KV cache and weights freed) before this returns."""
    llm = LLM(args.model, **engine_options(args))
    try:
        vocab = min(10000, llm.engine.vocab_size)
        prompts, outputs = make_requests(
            args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
            args.seed, vocab=vocab,
        )  # fmt: skip
        elapsed = run_kvserve(llm, args, prompts, outputs)
        ex, stats = llm.engine.executor, llm.stats()
        figures = dict(source=llm.engine.source, dtype=ex.dtype, device=ex.device, prompts=prompts,
                       outputs=outputs, seconds=elapsed, threads=torch.get_num_threads(),
                       preemptions=stats.num_preemptions, kv_blocks=stats.kv_blocks_total)
    finally:
        llm.shutdown()
    del llm
    _free_memory(figures["device"])
    return figures


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_ceiling(ours: dict, args) -> dict:
    """The workload's ideal time on this machine (``ceiling.ideal_workload_time``)."""
    hf_config = load_hf_config(ours["source"])
    ceiling = MatmulCeiling(hf_config, ours["dtype"], ours["device"])
    bandwidth = memory_bandwidth(ours["device"])
    ideal = ideal_workload_time(
        [len(p) for p in ours["prompts"]], ours["outputs"], args.max_num_seqs, args.max_num_batched_tokens,
        ceiling, bandwidth, kv_bytes_per_token(hf_config, ours["dtype"], args.kv_cache_dtype),
    )  # fmt: skip
    del ceiling
    _free_memory(ours["device"])
    return {"seconds": ideal.seconds, "output_tok_s": sum(ours["outputs"]) / ideal.seconds,
            "prefill_s": ideal.prefill_s, "decode_s": ideal.decode_s, "decode_steps": ideal.decode_steps,
            "kv_bound_steps": ideal.bandwidth_bound_steps, "prefill_matmul_tok_s": ideal.prefill_rate,
            "memory_gb_s": bandwidth / 1e9}


def run_peer(ours: dict, args) -> dict:
    """transformers on the same requests, weights, dtype and device."""
    model = load_transformers_model(ours["source"], ours["dtype"], ours["device"])
    prompts, outputs = ours["prompts"], ours["outputs"]
    if args.peer == "hf":
        seconds = run_hf(model, prompts, outputs, args.peer_batch)
        mode = f"generate, batches of {args.peer_batch}"
    else:
        seconds, mode = run_hf_continuous(model, prompts, outputs), "continuous batching"
    return {"seconds": seconds, "output_tok_s": sum(outputs) / seconds, "mode": mode}


def run_json_schema(args) -> None:
    """``--json-schema FILE``: the same requests constrained and unconstrained (benchmarks/structured.py)."""
    llm = LLM(args.model, **engine_options(args))
    try:
        prompts, outputs = make_requests(
            args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
            args.seed, vocab=min(10000, llm.engine.vocab_size),
        )  # fmt: skip
        with open(args.json_schema, encoding="utf-8") as f:
            run_structured_overhead(llm, f.read(), prompts, outputs, args.temperature, args.quiet)
    finally:
        llm.shutdown()


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.json_schema:
        run_json_schema(args)
        return None
    ours = run_ours(args)
    total = sum(ours["outputs"])
    dtype = str(ours["dtype"]).removeprefix("torch.")
    result = {
        "requests": args.num_requests, "prompt_tokens": sum(map(len, ours["prompts"])),
        "output_tokens": total, "dtype": dtype, "threads": ours["threads"],
        "kvserve": {"seconds": ours["seconds"], "output_tok_s": total / ours["seconds"],
                    "preemptions": ours["preemptions"], "kv_blocks": ours["kv_blocks"]},
    }  # fmt: skip
    print(f"requests={args.num_requests} prompt_tokens={result['prompt_tokens']} output_tokens={total}")
    print(f"kvserve      {ours['seconds']:8.2f} s  {total / ours['seconds']:8.1f} output tok/s  "
          f"({dtype}, {ours['threads']} threads; {ours['kv_blocks']} KV blocks, "
          f"{ours['preemptions']} preemptions)")
    total_params, active = active_parameters(load_hf_config(ours["source"]))
    tokens = result["prompt_tokens"] + total
    print(f"matmul weights {total_params / 1e6:.1f}M, {active / 1e6:.1f}M active per token: "
          f"{2 * active / 1e6:.1f} MFLOP/token, "
          f"kvserve {2 * active * tokens / ours['seconds'] / 1e9:.1f} GFLOP/s")
    if not args.no_ceiling:
        c = result["ceiling"] = measure_ceiling(ours, args)
        result["kvserve_over_ceiling"] = c["seconds"] / ours["seconds"]
        print(f"ceiling      {c['seconds']:8.2f} s  {c['output_tok_s']:8.1f} output tok/s  "
              f"(prefill {c['prefill_s']:.2f} s at the {c['prefill_matmul_tok_s']:.0f} tok/s matmul rate; "
              f"{c['decode_steps']} decode steps {c['decode_s']:.2f} s, {c['kv_bound_steps']} of them "
              f"bound by KV reads at {c['memory_gb_s']:.0f} GB/s)")
        print(f"kvserve / ceiling = {result['kvserve_over_ceiling']:.0%}")
    if args.peer != "none":
        try:
            peer = result["transformers"] = run_peer(ours, args)
        except Exception as e:  # the peer's failure must not lose kvserve's figures
            result["transformers"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"transformers failed: {type(e).__name__}: {e}")
        else:
            result["kvserve_over_transformers"] = peer["seconds"] / ours["seconds"]
            print(f"transformers {peer['seconds']:8.2f} s  {peer['output_tok_s']:8.1f} output tok/s  "
                  f"({peer['mode']})")
            print(f"ratio kvserve / transformers = {result['kvserve_over_transformers']:.2f}x")
    write_json(args.json, result)
    if args.plot:
        from kvserve.benchmarks.plots import plot_offline

        plot_offline(result, args.plot)
    return result


if __name__ == "__main__":
    main()
