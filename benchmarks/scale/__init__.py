"""GGUF at the sizes CPU users serve, made the way they make it (``make bench-scale``,
docs/performance/gguf_kquants.md): a random-weight checkpoint of a real model's shape
(``testing.random_model``; the bundled SmolLM2 tokenizer replaces its word-level one, so that
llama.cpp's converter recognises it and pads the vocabulary), converted to bf16 with llama.cpp's own
``convert_hf_to_gguf.py`` and quantized with its ``llama-quantize`` (both from the pinned sdist,
built once: ``benchmarks.peers.setup``'s ``llama.cpp-tools`` step), then served as loaded (no
``--quantization``) by kvserve and by llama-server, one after the other, through the peers harness;
``--with-vllm`` adds vLLM's CPU build on the bf16 checkpoint: in the same run as llama-server where
kvserve serves that checkpoint too (``--kvserve-loads hf``), else in a second run with kvserve on it.

Each file is made once under ``--work-dir`` (default ``$KVSERVE_PEERS_DIR/scale/<shape>``), written
beside its final name and renamed when whole, so a second run only serves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from kvserve.benchmarks.peers import compare, setup

SHAPES = ("smollm2-1.7b", "llama-3.2-1b", "llama-3.2-3b", "qwen3-1.7b", "gemma3-1b", "qwen3.5-0.8b",
          "qwen3.5-2b", "qwen3.5-tiny")
# the tiny shape checks the flow in seconds; its vocabulary is the bundled tokenizer's, as Gemma 3's is
CUT_VOCABULARY = ("gemma3-1b", "qwen3.5-tiny")
# kvserve's limits passed on when given (8k-token prompts at 16 streams need more than the defaults)
ENGINE_LIMITS = ("max_model_len", "max_num_seqs", "kv_cache_memory", "max_num_batched_tokens")


def checkpoint(shape: str, work: Path) -> Path:
    """The random Hugging Face directory (bf16 weights, the bundled tokenizer)."""
    import torch

    from kvserve.engine.model_loader.source import resolve_model
    from kvserve.engine.tokenizer.load import load_tokenizer
    from kvserve.testing.random_model import make_config, write_model_dir

    out = work / "hf"
    if out.is_dir():
        return out
    scratch = work / "hf.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    tokenizer = load_tokenizer(resolve_model("default"))
    # llama.cpp's Gemma 3 converter cuts the embedding down to the tokenizer's vocabulary (its Llama
    # converter pads the tokenizer instead): written at that size, both servers compute the same head
    overrides = {"vocab_size": len(tokenizer)} if shape in CUT_VOCABULARY else {}
    if shape == "qwen3.5-tiny":  # llama.cpp's qwen35 rotates 11 + 11 + 10 pairs: the real head of 256
        overrides["head_dim"] = 256
    write_model_dir(make_config(shape, **overrides), scratch, dtype=torch.bfloat16)
    tokenizer.save_pretrained(scratch)
    scratch.rename(out)
    return out


def quantized_gguf(paths: setup.PeerPaths, hf: Path, work: Path, quant: str, no_mtp: bool = False) -> Path:
    """``hf`` converted by llama.cpp to bf16, then quantized to ``quant`` by llama-quantize (``bf16``:
    the converted file as it is). ``no_mtp``: a Qwen3.5 checkpoint without the multi-token-prediction
    layer the Hub's have (the converter expects one unless told)."""
    bf16 = work / "model-bf16.gguf"
    if not bf16.exists():
        partial = bf16.with_suffix(".partial")
        setup.run([sys.executable, paths.llama_convert, hf, "--outtype", "bf16", "--outfile", partial,
                   *(["--no-mtp"] if no_mtp else [])], env=paths.converter_env())
        partial.rename(bf16)
    out = work / f"model-{quant}.gguf"
    if out.exists():
        return out
    partial = out.with_suffix(".partial")
    setup.run([paths.llama_quantize, bf16, partial, quant, str(len(os.sched_getaffinity(0)))])
    partial.rename(out)
    return out


def harness_args(args: argparse.Namespace, ours: Path, peers: list[tuple[str, str, Path]]) -> list[str]:
    """The peers harness on kvserve serving ``ours`` and each ``(peer, its model flag, its model)``
    of ``peers`` (by default the issue's workload: prompts of 64-400 tokens, 64 new tokens, one
    stream and ``--concurrency``'s levels, no open-loop levels)."""
    names = [peer for peer, _, _ in peers]
    models = [arg for _, flag, model in peers for arg in (flag, str(model))]
    return ["--systems", ",".join(["kvserve", *names]), "--model", str(ours), *models,
            "--peers-dir", str(args.peers_dir), "--concurrency", args.concurrency, "--rates", "none",
            "--num-requests", str(args.num_requests), "--prompt-len", args.prompt_len,
            "--output-len", args.output_len,
            "--dtype", "bfloat16", *(["--json", f"{args.json}.{'.'.join(names)}.json"] if args.json else []),
            *[f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ENGINE_LIMITS
              if getattr(args, name, None) is not None],
            *([f"--kvserve-flags=--max-step-time-ms={args.max_step_time_ms}"]
              if getattr(args, "max_step_time_ms", None) is not None else [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-1.7b")
    ap.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (Q4_K_M, Q5_K_M, Q6_K, Q8_0), "
                    "or bf16 for the converted file unquantized")
    ap.add_argument("--kvserve-loads", choices=("gguf", "hf"), default="gguf",
                    help="what kvserve serves: the GGUF file llama-server serves, or the HF checkpoint "
                    "it was converted from")
    ap.add_argument("--prompt-len", default="64:400", metavar="LO:HI", help="prompt tokens per request")
    ap.add_argument("--output-len", default="64", metavar="N[:M]", help="new tokens per request")
    ap.add_argument("--peers-dir", help="the peers' folder (default $KVSERVE_PEERS_DIR or "
                    "~/.cache/kvserve-peers)")
    ap.add_argument("--work-dir", help="where the checkpoint and GGUF files go (default "
                    "<peers-dir>/scale/<shape>)")
    ap.add_argument("--concurrency", default="1,16", help="closed-loop levels")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per level")
    ap.add_argument("--max-model-len", type=int, help="kvserve's (default: the model's, capped at 8192)")
    ap.add_argument("--max-num-seqs", type=int, help="kvserve's sequences at once")
    ap.add_argument("--kv-cache-memory", type=float, help="kvserve's KV (and state) cache, GiB")
    ap.add_argument("--max-step-time-ms", type=float,
                    help="kvserve's step time bound (default: the CPU's 500 ms; 0: none)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="kvserve's token budget of a step")
    ap.add_argument("--with-vllm", action="store_true", help="also the bf16 checkpoint: kvserve against vLLM")
    ap.add_argument("--json", help="results to <JSON>.<peers>.json "
                    "(llama.cpp; vllm; llama.cpp.vllm for one run of both)")
    args = ap.parse_args(argv)
    paths = setup.peers_dir(args.peers_dir)
    args.peers_dir = paths.root
    work = Path(args.work_dir) if args.work_dir else paths.root / "scale" / args.shape
    work.mkdir(parents=True, exist_ok=True)
    setup.setup_llama_tools(paths)
    hf = checkpoint(args.shape, work)
    gguf = quantized_gguf(paths, hf, work, args.quant, no_mtp=args.shape.startswith("qwen3.5"))
    print(f"{gguf}: {gguf.stat().st_size / 1e9:.2f} GB", flush=True)
    llama = ("llama.cpp", "--llama-gguf", gguf)
    vllm = ("vllm", "--vllm-model", hf)
    if args.with_vllm:
        setup.setup_vllm(paths)
    if args.kvserve_loads == "hf":  # one run: kvserve once, on the checkpoint both peers were given
        return compare.main(harness_args(args, hf, [llama, *([vllm] if args.with_vllm else [])]))
    status = compare.main(harness_args(args, gguf, [llama]))
    if args.with_vllm:  # vLLM serves the bf16 checkpoint: kvserve on the same, in a second run
        status = status or compare.main(harness_args(args, hf, [vllm]))
    return status
