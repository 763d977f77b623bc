"""The offline benchmark runs end to end (tiny random model, both transformers peers)."""

import json

import pytest

from kvserve.benchmarks import offline
from kvserve.testing.random_model import write_random_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(write_random_model("llama-tiny", tmp_path_factory.mktemp("llama-tiny")))


@pytest.mark.parametrize("peer", ["hf", pytest.param("hf-batch", marks=pytest.mark.slow)])  # (15 min suite)
def test_offline_benchmark_prints_throughput_ceiling_and_ratio(tiny_llama, peer, capsys, tmp_path):
    figures = offline.main(
        [
            "--model",
            tiny_llama,
            "--dtype",
            "float32",
            "--num-requests",
            "4",
            "--min-prompt",
            "8",
            "--max-prompt",
            "40",
            "--min-output",
            "4",
            "--max-output",
            "12",
            "--peer",
            peer,
            "--quiet",
            "--json",
            str(tmp_path / "figures.json"),
            "--plot",
            str(tmp_path / "figures.png"),
        ]
    )
    out = capsys.readouterr().out
    assert "kvserve" in out and "output tok/s" in out
    assert "kvserve / ceiling = " in out and "ratio kvserve / transformers" in out
    assert json.loads((tmp_path / "figures.json").read_text()) == json.loads(json.dumps(figures))
    assert (tmp_path / "figures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ceiling = figures["ceiling"]
    assert ceiling["seconds"] == pytest.approx(ceiling["prefill_s"] + ceiling["decode_s"])
    assert figures["kvserve_over_ceiling"] > 0 and figures["transformers"]["output_tok_s"] > 0


def test_offline_benchmark_reports_the_kv_cache_it_ran_with(tiny_llama, capsys):
    """--kv-cache-memory and --kv-cache-dtype reach the engine: an int8 cache holds more blocks in the
    same memory, and the figures say how many and how often requests were preempted."""
    blocks = {}
    for kv in ("auto", "int8"):
        workload = ["--num-requests", "2", "--min-prompt", "8", "--max-prompt", "16", "--min-output", "2",
                    "--max-output", "4"]
        cache = ["--kv-cache-memory", "0.01", "--kv-cache-dtype", kv]
        figures = offline.main(["--model", tiny_llama, "--dtype", "float32", *workload, "--peer", "none",
                                "--no-ceiling", "--quiet", *cache])
        blocks[kv] = figures["kvserve"]["kv_blocks"]
        assert figures["kvserve"]["preemptions"] == 0
        assert f"{blocks[kv]} KV blocks, 0 preemptions" in capsys.readouterr().out
    assert blocks["int8"] > blocks["auto"]


def test_a_failing_peer_keeps_kvserves_figures(tiny_llama, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("peer out of memory")

    monkeypatch.setattr(offline, "load_transformers_model", broken)
    args = ["--model", tiny_llama, "--dtype", "float32", "--num-requests", "2", "--min-prompt", "4",
            "--max-prompt", "8", "--min-output", "2", "--max-output", "4", "--peer", "hf", "--quiet",
            "--no-ceiling"]  # fmt: skip
    figures = offline.main(args)
    assert figures["kvserve"]["output_tok_s"] > 0
    assert figures["transformers"] == {"error": "RuntimeError: peer out of memory"}
    assert "transformers failed: RuntimeError: peer out of memory" in capsys.readouterr().out


def test_serving_benchmark_prints_ratios_and_cpu_per_token(tiny_llama, capsys):
    from kvserve.benchmarks.serving import bench as serving

    serving.main(["--model", tiny_llama, "--dtype", "float32", "--num-requests", "6", "--concurrency", "3",
                  "--prompt-len", "8:24", "--output-len", "6", "--token-range", "10:1000"])
    out = capsys.readouterr().out
    assert "== service / in-process" in out and "throughput" in out
    assert out.count("CPU s per 1,000 streamed tokens") == 2
    assert "host work" in out
    assert "load generator (this process, same cores) CPU" in out


def test_serving_benchmark_alternates_rounds_on_fresh_workloads(tiny_llama, capsys, tmp_path):
    from kvserve.benchmarks.serving import bench as serving

    out_json = tmp_path / "rounds.json"
    serving.main(["--model", tiny_llama, "--dtype", "float32", "--num-requests", "4", "--concurrency", "2",
                  "--prompt-len", "8:16", "--output-len", "4", "--token-range", "10:1000", "--rounds", "2",
                  "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "---- round 1 of 2" in out and "---- round 2 of 2" in out and "== median over 2 rounds" in out
    figures = json.loads(out_json.read_text())
    assert len(figures["rounds"]) == 2
    for r in figures["rounds"]:
        assert r["service"]["requests_ok"] == r["in_process"]["requests_ok"] == 4
        assert r["service"]["output_tokens"] == r["in_process"]["output_tokens"] == 16
    ratios = [r["ratio"]["output_tokens_per_s"] for r in figures["rounds"]]
    assert figures["ratio"]["output_tokens_per_s"] == pytest.approx(sum(ratios) / 2)
    # each round its own prompts: no round hits the prefix cache on an earlier round's prompts
    args = serving.build_parser().parse_args(["--num-requests", "4", "--prompt-len", "8:16"])
    assert serving.make_workload(args, seed=0)[0].prompt != serving.make_workload(args, seed=1)[0].prompt


def test_grpc_floor_counts_every_message_and_bounds_the_ratio(capsys, tmp_path):
    from kvserve.benchmarks.serving import floor as grpc_floor

    out_json = tmp_path / "floor.json"
    grpc_floor.main(["--num-requests", "6", "--concurrency", "3", "--tokens", "5", "--step-ms", "1",
                     "--in-process-cpu", "0.01", "--in-process-wall", "0.02", "--cores", "2",
                     "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "30 messages over 3 streams" in out and "service / in-process <=" in out
    figures = json.loads(out_json.read_text())
    assert figures["messages"] == 30  # every stream read to its end (the server's last message included)
    assert figures["server_cpu_s"] >= 0 and figures["client_cpu_s"] > 0  # the server's in clock ticks
    floor_wall = (0.01 + figures["server_cpu_s"] + figures["client_cpu_s"]) / 2
    assert figures["best_ratio"] == pytest.approx(0.02 / max(0.02, floor_wall))


def test_serving_benchmark_rounds_need_a_started_server_and_the_comparison():
    from kvserve.benchmarks.serving import bench as serving

    for extra in (["--target", "127.0.0.1:1"], ["--no-compare"]):
        with pytest.raises(SystemExit, match="--rounds alternates"):
            serving.main(["--rounds", "2", *extra])
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        serving.main(["--rounds", "0"])


def test_profile_step_interleaves_rounds_and_reports_the_ratios(tiny_llama, capsys, tmp_path):
    from kvserve.benchmarks import profile_step

    out = tmp_path / "step.json"
    result = profile_step.main(["--model", tiny_llama, "--dtype", "float32", "--batch", "4",
                                "--context", "24", "--steps", "2", "--rounds", "3", "--prefill-chunks", "2",
                                "--max-num-batched-tokens", "64", "--compete", "1", "--json", str(out)])
    decode, prefill = result["decode"], result["prefill"]
    # the busy process's CPU is measured per round (CPU clocks advance at scheduler ticks: rounds of
    # a few ms read coarse values; the benchmark's real rounds last ~0.5 s)
    assert len(decode["rounds_busy_cpus"]) == 3
    assert round(decode["busy_cpus"], 3) in decode["rounds_busy_cpus"]
    assert decode["cpus_used"] > 0 and decode["step_ms_beside_busy"] > 0  # scheduled_cpu_s: test_procfs
    assert len(decode["rounds_step_ms"]) == len(decode["rounds_matmul_ms"]) == 3
    assert decode["step_ms"] == pytest.approx(min(decode["rounds_step_ms"]), abs=0.01)
    assert decode["step_over_matmul"] == pytest.approx(decode["step_ms"] / decode["matmul_ms"])
    assert 0 < decode["sampler_ms"] < decode["step_ms"] and 0 < decode["forward_ms"] < decode["step_ms"]
    share = prefill["tokens_per_s"] / prefill["matmul_tokens_per_s"]
    assert prefill["share_of_matmul_rate"] == pytest.approx(share)
    assert json.loads(out.read_text())["decode"]["batch"] == 4
    printed = capsys.readouterr().out
    assert "step / matmul" in printed and "of it" in printed and "in proportion to the CPU taken" in printed


def test_profile_step_times_the_fused_decode_step_against_the_per_op_path(tiny_llama, capsys):
    from kvserve.benchmarks import profile_step
    from kvserve.kernels.cpu.bindings import load_kernels

    if load_kernels() is None or not load_kernels().fused_row_kernel:
        with pytest.raises(SystemExit, match="does not apply|AVX-512"):
            profile_step.main(["--model", tiny_llama, "--dtype", "float32", "--batch", "3", "--fused-ab"])
        pytest.skip("the fused decode step takes float32 weights on AVX-512 CPUs")

    result = profile_step.main(["--model", tiny_llama, "--dtype", "float32", "--batch", "3",
                                "--context", "12", "--steps", "2", "--rounds", "2", "--fused-ab"])
    assert len(result["rounds_ms"]["fused"]) == len(result["rounds_ms"]["per_op"]) == 4
    assert result["fused"] > 0 and result["per_op"] > 0
    assert "fused" in capsys.readouterr().out


def test_profile_step_times_gemm_c_against_onednn_or_says_why_it_cannot(tiny_llama, capsys):
    from kvserve.benchmarks import profile_step
    from kvserve.engine.layers.cpu_matmul import gemm_kernel, onednn_bf16

    argv = ["--model", tiny_llama, "--batch", "9", "--context", "12", "--steps", "2", "--rounds", "2",
            "--gemm-ab"]
    with pytest.raises(SystemExit, match="no projection multiplies through csrc/gemm.c"):
        profile_step.main([*argv, "--dtype", "float32"])
    if gemm_kernel() is None:
        pytest.skip("csrc/gemm.c does not serve here (no AVX-512 or AVX2, or AMX)")
    result = profile_step.main([*argv, "--dtype", "bfloat16"])
    other = "onednn" if onednn_bf16() else "torch"  # torch's own matmul where oneDNN has no bfloat16
    assert len(result["rounds_ms"]["gemm"]) == len(result["rounds_ms"][other]) == 4
    assert result["gemm"] > 0 and result[other] > 0
    assert "gemm.c" in capsys.readouterr().out


def test_attention_benchmark_compares_the_kernel_with_torch(tmp_path):
    from kvserve.benchmarks import attention_cpu

    result = attention_cpu.main(["--dtype", "float32", "--batch", "3", "--context", "40", "--layers", "2",
                                 "--prefill", "2x20", "1x33", "--repeats", "1",
                                 "--json", str(tmp_path / "a.json")])
    assert result["decode"]["max_abs_diff"] < 1e-4 and result["decode"]["speedup"] > 0
    assert [(p["prompts"], p["length"]) for p in result["prefill"]] == [(2, 20), (1, 33)]
    assert all(p["max_abs_diff"] < 1e-4 for p in result["prefill"])
    assert json.loads((tmp_path / "a.json").read_text())["decode"]["batch"] == 3


def test_attention_benchmark_reads_an_int8_cache_on_both_paths():
    from kvserve.benchmarks import attention_cpu

    result = attention_cpu.main(["--kv-cache-dtype", "int8", "--dtype", "float32", "--batch", "3",
                                 "--context", "40", "--layers", "2", "--prefill", "1x20", "--repeats", "1"])
    decode = result["decode"]
    assert result["kv_cache_dtype"] == "int8" and decode["max_abs_diff"] < 1e-4
    # the K/V bytes it reports are the int8 rows' (64 values + a 4-byte scale), not float32's
    assert decode["kernel_kv_gb_per_s"] == pytest.approx(
        2 * 2 * 3 * 40 * 3 * (64 + 4) / decode["kernel_ms"] * 1e3 / 1e9)
