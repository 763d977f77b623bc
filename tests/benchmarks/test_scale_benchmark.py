"""``make bench-scale`` (benchmarks/scale): the harness flags it passes are the peers harness's, the
shapes are random_model's, and the llama.cpp tools are a setup step of their own, asked for by name
(the build itself is the lead's to run: 10+ minutes of both cores)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.benchmarks import scale
from kvserve.benchmarks.peers import compare, setup
from kvserve.testing.random_model import SHAPES


def test_its_shapes_are_random_model_shapes():
    assert set(scale.SHAPES) <= set(SHAPES)


def parse(argv: list[str]) -> argparse.Namespace:
    return compare.build_parser().parse_args(argv)


def test_the_harness_takes_its_flags_for_llama_server_and_vllm(tmp_path):
    args = argparse.Namespace(peers_dir=tmp_path, concurrency="1,16", num_requests=16, json=None,
                              prompt_len="64:400", output_len="64")
    model = Path("/models/model-Q4_K_M.gguf")
    parsed = parse(scale.harness_args(args, model, [("llama.cpp", "--llama-gguf", model)]))
    assert parsed.systems == ["kvserve", "llama.cpp"] and parsed.concurrency == [1, 16] and parsed.rates == []
    assert parsed.model == parsed.llama_gguf == str(model) and parsed.output_len == (64, 64)
    assert parsed.prompt_len == (64, 400)
    parsed = parse(scale.harness_args(args, tmp_path, [("vllm", "--vllm-model", tmp_path)]))
    assert parsed.systems == ["kvserve", "vllm"] and parsed.vllm_model == str(tmp_path)
    args.max_step_time_ms, args.max_num_batched_tokens = 0.0, 1024  # kvserve's step bound and budget
    parsed = parse(scale.harness_args(args, model, [("llama.cpp", "--llama-gguf", model)]))
    assert parsed.kvserve_flags == "--max-step-time-ms=0.0" and parsed.max_num_batched_tokens == 1024


def test_kvserve_may_serve_the_checkpoint_beside_llama_servers_gguf(tmp_path):
    """--kvserve-loads hf (Gemma 3's comparison): kvserve on the HF directory, llama-server on the
    file llama.cpp's converter made of it, with the issue's long prompts."""
    args = argparse.Namespace(peers_dir=tmp_path, concurrency="16", num_requests=16, json=None,
                              prompt_len="2048:6144", output_len="32")
    gguf = tmp_path / "model-bf16.gguf"
    parsed = parse(scale.harness_args(args, tmp_path, [("llama.cpp", "--llama-gguf", gguf)]))
    assert parsed.model == str(tmp_path) and parsed.llama_gguf == str(gguf)
    assert parsed.prompt_len == (2048, 6144) and parsed.output_len == (32, 32) and parsed.concurrency == [16]
    # with --with-vllm: the three in one run, kvserve once, vLLM on the same checkpoint
    args.json = str(tmp_path / "gemma")
    parsed = parse(scale.harness_args(args, tmp_path, [("llama.cpp", "--llama-gguf", gguf),
                                                        ("vllm", "--vllm-model", tmp_path)]))
    assert parsed.systems == ["kvserve", "llama.cpp", "vllm"] and parsed.vllm_model == str(tmp_path)
    assert parsed.llama_gguf == str(gguf) and parsed.json == str(tmp_path / "gemma.llama.cpp.vllm.json")


def test_the_tools_step_is_not_part_of_bench_peers(tmp_path):
    assert "llama.cpp-tools" in setup.STEPS and "llama.cpp-tools" not in setup.DEFAULT_STEPS
    paths = setup.peers_dir(str(tmp_path))
    assert paths.llama_quantize == paths.llama_server.with_name("llama-quantize")


def test_the_kernel_comparison_runs_on_a_small_shape(capsys):
    from kvserve.benchmarks.scale import kernels

    assert kernels.main(["--shape", "32x256", "--rows", "1,5", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(kernels.NAMES) * 2 and all("x" in line for line in lines[1:])


def test_the_kernel_comparison_times_one_threads_cpu_against_another_build(capsys):
    """``--clock thread --threads 1 --against SO``: the peak-relative A/B of two builds' GEMM in one
    run (here the build against itself); the thread clock refuses more than one thread."""
    import pytest
    import torch

    from kvserve.benchmarks.scale import kernels
    from kvserve.kernels.cpu.bindings import build, compiler
    from kvserve.kernels.cpu.kquant import kquant_kernels

    kq = kquant_kernels()
    if kq is None:
        pytest.skip("the CPU kernels are not built here (no compiler)")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):
            kernels.main(["--clock", "thread", "--threads", "2"])
        argv = ["--shape", "32x256", "--rows", "16", "--repeat", "1", "--rounds", "1", "--types", "Q4_K",
                "--clock", "thread", "--threads", "1", "--against", str(build(compiler()))]
        assert kernels.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    if kq.gemm_takes(12, preferred=False):
        assert "gemm_against" in out and "x the other build's" in out


def test_a_hybrids_long_prompts_pass_kvserves_limits_on(tmp_path, monkeypatch):
    """Qwen3.5 at 8k-token prompts and 16 streams: kvserve's limits reach its server's flags."""
    args = argparse.Namespace(peers_dir=tmp_path, concurrency="1,16", num_requests=16, json=None,
                              prompt_len="8192", output_len="64", max_model_len=9216, max_num_seqs=16,
                              kv_cache_memory=4.0)
    parsed = parse(scale.harness_args(args, tmp_path, [("llama.cpp", "--llama-gguf", tmp_path / "m.gguf")]))
    assert (parsed.max_model_len, parsed.max_num_seqs, parsed.kv_cache_memory) == (9216, 16, 4.0)
    assert parsed.prompt_len == (8192, 8192)
    assert {"qwen3.5-2b", "qwen3.5-tiny"} <= set(scale.SHAPES)
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # the converter imports its package from beside it
    assert "PYTHONSAFEPATH" not in setup.peers_dir(str(tmp_path)).converter_env()


def test_the_gated_delta_comparison_runs_on_the_tiny_shape(capsys):
    from kvserve.benchmarks.scale.hybrid import gated_delta

    assert gated_delta.main(["--shape", "qwen3.5-tiny", "--batch", "1", "3", "--slots", "4",
                             "--prompt", "70", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 + 1 + 1 and all("x  (max diff" in line for line in lines[1:])
    assert lines[-1].startswith("norm ")  # the gated norm, torch against C


def test_the_hybrid_verification_comparison_runs_on_the_tiny_shape(capsys):
    """Both ways leave the same states (recompute, kvserve's, and per-position copies)."""
    from kvserve.benchmarks.scale.hybrid import verify as hybrid_verify

    assert hybrid_verify.main(["--shape", "qwen3.5-tiny", "--batch", "1", "3", "--drafts", "3",
                               "--slots", "4", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * 3 and all(line.endswith("(same states: True)") for line in lines[1:])


def test_the_hybrid_prefill_comparison_runs_on_the_tiny_shape(tmp_path, capsys):
    from kvserve.benchmarks.scale.hybrid import prefill as hybrid_prefill
    from kvserve.engine.models.qwen3_5 import GatedDeltaNet
    from kvserve.testing.random_model import write_random_model

    model = write_random_model("qwen3.5-tiny", tmp_path / "m")
    figures = hybrid_prefill.main(["--model", str(model), "--prompt", "40", "--chunks", "16", "40",
                                   "--norm-ab", "--rounds", "1"])
    assert [(a["chunk"], a["norm"]) for a in figures["arms"]] == [(16, "C"), (16, "torch"), (40, "C"),
                                                                  (40, "torch")]
    assert all(a["tok_s"] > 0 for a in figures["arms"]) and len(capsys.readouterr().out.splitlines()) == 4
    assert GatedDeltaNet._normed is hybrid_prefill.NORMED  # the layer's own again


def test_the_hybrid_decode_breakdown_and_ab_run_on_the_tiny_shape(tmp_path, capsys):
    from kvserve.benchmarks.scale.hybrid import decode as hybrid_decode
    from kvserve.engine.models.qwen3_5 import GatedDeltaNet
    from kvserve.kernels.cpu.bindings import load_kernels
    from kvserve.testing.random_model import make_config, write_model_dir

    # 8 value heads: every projection packs for gemm.c, so the fused step runs on every x86 build
    model = write_model_dir(make_config("qwen3.5-tiny", linear_num_value_heads=8), tmp_path / "m")
    kernels = load_kernels()
    fused = kernels is not None and kernels.fused_rows
    r = hybrid_decode.main(["--model", str(model), "--context", "40", "--steps", "2", "--rounds", "1",
                            "--breakdown", *(["--ab"] if fused else [])])
    ms = r["breakdown"]["ms"]
    assert ms["step (mean)"] > 0 and ms["gdn in_proj"] > 0 and ms["lm_head"] > 0 and ms["sampler"] > 0
    assert ms["gdn conv+rule (C)"] > 0 and r["breakdown"]["alone_ms"]["full qkv_proj"] > 0
    assert GatedDeltaNet._decode.__qualname__ == "GatedDeltaNet._decode"  # the layer's own again
    if fused:
        assert r["ab"]["fused"] > 0 and r["ab"]["per_op"] > 0
    assert capsys.readouterr().out.startswith("decode step, one stream")
