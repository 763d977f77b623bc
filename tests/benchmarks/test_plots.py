"""Benchmark figures: the serving benchmark's concurrency sweep end to end (a real server on a
tiny random model) writes its JSON and a PNG; the offline figure draws kvserve, its peer and
the ceiling from offline.py's JSON shape; the plots command redraws either from a file."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("matplotlib", reason="matplotlib not installed (the plot extra)")

from kvserve.benchmarks import plots  # noqa: E402
from kvserve.benchmarks.serving import bench as serving  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_PNG_BYTES = 150_000  # docs/performance/serving.md carries one: keep them small


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) < MAX_PNG_BYTES
    return struct.unpack(">II", data[16:24])


def test_serving_sweep_writes_json_and_a_figure(tiny_qwen2_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = serving.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--num-requests", "4",
                       "--concurrency", "1,4", "--prompt-len", "8:16", "--output-len", "3",
                       "--token-range", "10:500", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["levels"] == [1, 4] and len(result["service"]) == 2
    for run in result["service"]:
        assert run["requests_ok"] == 4 and run["output_tokens"] == 12 and not run["errors"]
        assert run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["p50"]
    assert png_size(out_png) == (800, 320)
    assert "concurrency 4" in capsys.readouterr().out


def test_concurrency_levels_are_checked():
    with pytest.raises(SystemExit):
        serving.build_parser().parse_args(["--concurrency", "8,0"])
    assert serving.build_parser().parse_args(["--concurrency", "1,8,32"]).concurrency == [1, 8, 32]


def test_offline_figure_shows_kvserve_peers_and_ceiling(tmp_path):
    result = {"requests": 64, "dtype": "bfloat16", "kvserve": {"seconds": 30.0, "output_tok_s": 140.0},
              "ceiling": {"seconds": 5.0, "output_tok_s": 840.0},
              "transformers": {"seconds": 56.0, "output_tok_s": 75.0, "mode": "generate, batches of 16"}}
    path = tmp_path / "offline.json"
    path.write_text(json.dumps(result))
    assert plots.main([str(path), str(tmp_path / "offline.png")]) == 0
    width, height = png_size(tmp_path / "offline.png")
    assert width == 640 and height > 100
    failed_peer = {**result, "transformers": {"error": "OutOfMemoryError"}}
    plots.plot_result(failed_peer, str(tmp_path / "no-peer.png"))  # a failed peer is left out
    assert png_size(tmp_path / "no-peer.png")[1] < height
