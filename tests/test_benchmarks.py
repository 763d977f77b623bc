"""The offline benchmark runs end to end (tiny random model, both transformers peers)."""

import pytest

from kvserve.benchmarks import offline
from kvserve.benchmarks.random_model import write_random_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(write_random_model("llama-tiny", tmp_path_factory.mktemp("llama-tiny")))


@pytest.mark.parametrize("peer", ["hf", "hf-batch"])
def test_offline_benchmark_prints_throughput_and_ratio(tiny_llama, peer, capsys):
    offline.main(
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
        ]
    )
    out = capsys.readouterr().out
    assert "kvserve" in out and "output tok/s" in out
    assert "ratio kvserve / transformers" in out


def test_serving_benchmark_prints_ratios_and_cpu_per_token(tiny_llama, capsys):
    from kvserve.benchmarks import serving

    serving.main(["--model", tiny_llama, "--dtype", "float32", "--num-requests", "6", "--concurrency", "3",
                  "--prompt-len", "8:24", "--output-len", "6", "--token-range", "10:1000"])
    out = capsys.readouterr().out
    assert "== service / in-process" in out and "throughput" in out
    assert out.count("CPU s per 1,000 streamed tokens") == 2
    assert "host work" in out
