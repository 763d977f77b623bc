"""The peers' harness (benchmarks/peers/), without the peers: the HTTP/1.1 client and the
Server-Sent Events reader against a tiny asyncio HTTP server on 127.0.0.1 (chunked, plain and
close-delimited bodies, split anywhere), each peer's dialect against a fake of that peer, how the
peers would be started, what it says when they are not set up, and one tiny run of the whole
harness against kvserve alone, so that it cannot rot. vLLM and llama-server never run here."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import torch

from kvserve.benchmarks.peers import compare, dialects, servers, setup
from kvserve.benchmarks.peers.sse import SSEDecoder, sse_events
from kvserve.benchmarks.serving.load import Request


# ---- a tiny HTTP server on a real loopback socket --------------------------------------------
@contextlib.asynccontextmanager
async def http_server(routes: dict[str, bytes], piece: int = 7):
    """Answers ``routes[path]`` (a whole raw response) in ``piece``-byte writes, then closes;
    yields (port, the requests seen as (method, path, headers, JSON body))."""
    seen = []

    async def handle(reader, writer):
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            first, *lines = head.split("\r\n")
            method, path, _ = first.split()
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
            body = await reader.readexactly(int(headers["content-length"]))
            seen.append((method, path, headers, json.loads(body)))
            raw = routes[path]
            for i in range(0, len(raw), piece):
                writer.write(raw[i:i + piece])
                await writer.drain()
                await asyncio.sleep(0.0005)
        except ConnectionError:
            pass  # the client had read all it wanted
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], seen


def sse(*events, sep: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + sep + sep
                    for e in events)


def chunked(body: bytes, size: int = 11) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"


def plain(body: bytes, status: str = "200 OK", length: bool = True) -> bytes:
    size = f"Content-Length: {len(body)}\r\n" if length else ""
    return f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\n{size}\r\n".encode() + body


# ---- Server-Sent Events and HTTP ---------------------------------------------------------------
def test_sse_decoder_finds_the_same_events_wherever_the_bytes_split():
    raw = (b": a comment\r\ndata: {\"a\": 1}\r\n\r\ndata: line one\ndata:line two\n\n"
           b"event: end\rdata: [DONE]\r\rerror: {\"code\": 500}\n\ndata: tail")
    want = [{"data": '{"a": 1}'}, {"data": "line one\nline two"}, {"event": "end", "data": "[DONE]"},
            {"error": '{"code": 500}'}, {"data": "tail"}]
    for cut in range(len(raw) + 1):
        decoder = SSEDecoder()
        got = decoder.feed(raw[:cut]) + decoder.feed(raw[cut:])
        assert got + decoder.flush() == want, cut
    byte_by_byte = SSEDecoder()
    assert [e for i in range(len(raw)) for e in byte_by_byte.feed(raw[i:i + 1])] == want[:4]


@pytest.mark.parametrize("framing", ["chunked", "content-length", "close"])
def test_post_stream_reads_every_body_framing_over_a_real_socket(framing):
    body = sse({"n": 1}, {"n": 2}, b"[DONE]", sep=b"\r\n")
    raw = {"chunked": chunked(body), "content-length": plain(body),
           "close": plain(body, length=False)}[framing]

    async def go():
        async with http_server({"/x": raw}) as (port, seen):
            events = [e async for e in sse_events("127.0.0.1", port, "/x", {"prompt": [1, 2]})]
        return events, seen

    events, seen = asyncio.run(go())
    assert events == [{"data": '{"n": 1}'}, {"data": '{"n": 2}'}, {"data": "[DONE]"}]
    ((method, path, headers, body_sent),) = seen
    assert (method, path, body_sent) == ("POST", "/x", {"prompt": [1, 2]})
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"


# ---- the peers' dialects against fakes of them ----------------------------------------------------
def run_dialect(stream, raw: bytes, *args):
    async def go():
        async with http_server({"/v1/completions": raw, "/completion": raw}) as (port, seen):
            trace = await stream("127.0.0.1", port, Request([5, 6, 7], 4, 0.0), *args)
        return trace, seen

    return asyncio.run(go())


def vllm_chunk(**choice) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, **choice}]}


@pytest.mark.parametrize(("usage", "counted"), [(5, 5), (6, 6), (3, 3), (None, 5)])
def test_vllm_dialect_counts_token_ids_and_squares_the_count_with_usage(usage, counted):
    events = [vllm_chunk(text="a", token_ids=[11]), vllm_chunk(text="", token_ids=[12, 13]),
              vllm_chunk(text="b"), vllm_chunk(text="c")]
    if usage is not None:
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}})
    trace, seen = run_dialect(dialects.stream_vllm, chunked(sse(*events, b"[DONE]")), 0.6)
    assert trace.error is None and len(trace.token_times) == counted
    assert trace.sent <= trace.token_times[0] and trace.token_times == sorted(trace.token_times)
    assert trace.token_times[-1] <= trace.end
    body = seen[0][3]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.6, 1.0, -1, 0.0)


def test_llama_dialect_counts_each_events_tokens_until_stop():
    events = [{"content": "a", "tokens": [11], "stop": False},
              {"content": "bc", "tokens": [12, 13], "stop": False},
              {"content": "d", "stop": False},  # no tokens field: one
              {"content": "", "tokens": [], "stop": True, "timings": {}}]
    trace, seen = run_dialect(dialects.stream_llama, chunked(sse(*events)), 0.6)
    assert trace.error is None and len(trace.token_times) == 4
    body = seen[0][3]
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 4 and body["ignore_eos"] is True
    assert body["return_tokens"] is True and body["cache_prompt"] is True and body["stream"] is True
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"]) == \
        (0.6, 0, 1.0, 0.0, 1.0)


def test_dialects_report_http_and_in_stream_errors():
    busy = plain(b'{"error": {"code": 503, "message": "Loading model"}}', "503 Service Unavailable")
    trace, _ = run_dialect(dialects.stream_llama, busy, 0.6)
    assert trace.error == "HTTP_503" and trace.token_times == []
    in_stream = chunked(sse({"content": "a", "tokens": [1]}) + b'error: {"type": "server_error"}\n\n')
    assert run_dialect(dialects.stream_llama, in_stream, 0.6)[0].error == "server_error"
    bad = chunked(sse(vllm_chunk(text="a"), {"error": {"type": "BadRequestError", "code": 400}}))
    assert run_dialect(dialects.stream_vllm, bad, 0.6)[0].error == "BadRequestError"


def test_every_system_gets_the_same_plain_temperature_sampling():
    assert dialects.sampling_fields(0.6) == {"temperature": 0.6, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                             "repetition_penalty": 1.0}


# ---- starting the peers, and what the harness says without them -----------------------------------
def test_peer_commands_bind_the_cpus_this_process_may_use(tmp_path):
    assert servers.cpu_list({0, 1}) == "0-1" and servers.cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    vllm = servers.vllm_server(tmp_path / "python", tmp_path / "hf", "bfloat16", "m", 1.0)
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == servers.cpu_list()
    assert vllm.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vllm.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and str(vllm.port) in vllm.argv
    assert servers.slot_context(400, 128) == 1024 and servers.slot_context(1000, 128) == 1280
    llama = servers.llama_server(tmp_path / "llama-server", "m.gguf", 32, 1024, 1.0)
    flags = dict(zip(llama.argv[1::2], llama.argv[2::2], strict=False))
    assert (flags["-np"], flags["-c"], flags["--port"]) == ("32", "32768", str(llama.port))


def test_missing_peers_are_named_with_how_to_set_them_up(tmp_path):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--systems", "kvserve,vllm,llama.cpp", "--peers-dir", str(tmp_path)])
    message = str(exc.value)
    assert "vllm: missing vLLM's virtualenv" in message
    assert "llama.cpp: missing the llama-server build" in message
    assert "make bench-peers" in message and "--systems kvserve" in message
    assert setup.main(["--check", "--dir", str(tmp_path)]) == 1
    with pytest.raises(SystemExit, match="bundled model unless given theirs"):
        compare.main(["--systems", "vllm", "--model", str(tmp_path), "--peers-dir", str(tmp_path)])
    # a peer given its model's files (make bench-scale's) needs no converted bundled weights
    with pytest.raises(SystemExit) as exc:
        compare.main(["--systems", "vllm,llama.cpp", "--model", "m.gguf", "--llama-gguf", "m.gguf",
                      "--vllm-model", str(tmp_path), "--peers-dir", str(tmp_path)])
    assert "missing vLLM's virtualenv" in str(exc.value) and "HF weights" not in str(exc.value)
    assert setup.missing("llama.cpp-tools", setup.peers_dir(str(tmp_path))) == [
        f"llama-quantize and convert_hf_to_gguf.py ({tmp_path / 'llama.cpp'})"]


def test_level_lists_parse():
    assert compare.parse_rates("none") == [] and compare.parse_rates("1,2.5") == [1.0, 2.5]
    assert compare.parse_systems("vllm,kvserve,vllm") == ["vllm", "kvserve"]
    for parse, text in ((compare.parse_rates, "0"), (compare.parse_systems, "tgi")):
        with pytest.raises(Exception, match="expected"):
            parse(text)


# ---- the whole harness without the peers: kvserve served and its engine in process, tiny --------
def test_harness_runs_kvserve_and_its_engine_and_prints_their_rows(tmp_path, capsys):
    from kvserve.testing.random_model import write_random_model

    model = write_random_model("qwen3-tiny", tmp_path / "model", dtype=torch.float32)
    out_json, png = tmp_path / "peers.json", tmp_path / "peers.png"
    status = compare.main([
        "--systems", "kvserve,engine", "--model", str(model), "--dtype", "float32", "--num-requests", "4",
        "--concurrency", "1,2", "--rates", "50", "--prompt-len", "8:16", "--output-len", "4",
        "--temperature", "0.6", "--token-range", "10:1000", "--peers-dir", str(tmp_path / "no-peers"),
        "--json", str(out_json), "--plot", str(png)])
    assert status == 0
    out = capsys.readouterr().out
    table = out[out.index("== results"):]
    for system in ("kvserve", "engine"):
        rows = [line.split() for line in table.splitlines() if line.startswith(system + " ")]
        assert [r[1] for r in rows] == ["c=1", "c=2", "50/s"]
        for r in rows:
            tok_s, ttft50, ttft99, itl50, itl99 = map(float, r[2:7])
            assert tok_s > 0 and 0 < ttft50 <= ttft99 and 0 <= itl50 <= itl99
            assert r[7:] == ["4", "-"]  # 4 requests ok, no errors
    result = json.loads(out_json.read_text())
    assert [lv["kind"] for lv in result["levels"]] == ["concurrency", "concurrency", "rate"]
    for system in ("kvserve", "engine"):
        assert [r["output_tokens"] for r in result["systems"][system]["levels"]] == [16, 16, 16]
    # what the service keeps of its engine, per level
    assert list(result["ratios"]) == ["engine"] and "== kvserve / engine" in out
    assert all(r["output_tokens_per_s"] > 0 for r in result["ratios"]["engine"])
    assert png.stat().st_size < 200_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_the_engine_system_builds_the_config_the_server_would():
    from kvserve.benchmarks.instruments.in_process import engine_config

    config = engine_config(["--dtype=float32", "--max-num-seqs=7", "--max-num-batched-tokens=96",
                            "--max-queue=256", "--stream-interval=1", "--log-level", "warning"])
    assert (config.dtype, config.max_num_seqs, config.max_num_batched_tokens) == ("float32", 7, 96)


def test_ratios_and_the_goodput_figure_cover_every_peer_that_ran(tmp_path, capsys):
    from kvserve.benchmarks.peers.table import plot_goodput, print_ratios, print_table

    def run(tok_s, ttft):
        return {"requests_ok": 4, "errors": {}, "output_tokens_per_s": tok_s,
                "ttft_ms": {"p50": ttft, "p90": ttft, "p99": 2 * ttft},
                "itl_ms": {"p50": 10.0, "p90": 11.0, "p99": 12.0}}

    levels = [{"kind": "concurrency", "value": 1}, {"kind": "concurrency", "value": 8},
              {"kind": "rate", "value": 2.0}]
    result = {"workload": "synthetic", "levels": levels, "systems": {
        "kvserve": {"levels": [run(100, 50), run(300, 200), run(150, 80)]},
        "vllm": {"levels": [run(50, 100), run(200, 400), run(150, 160)]},
        "llama.cpp": {"error": "RuntimeError: llama.cpp exited with status 1"}}}
    print_table(result)
    got = print_ratios(result)
    out = capsys.readouterr().out
    assert "llama.cpp  failed: RuntimeError" in out and "== kvserve / vllm" in out
    assert list(got) == ["vllm"]
    assert [round(r["output_tokens_per_s"], 2) for r in got["vllm"]] == [2.0, 1.5, 1.0]
    assert [r["ttft_p99"] for r in got["vllm"]] == [0.5, 0.5, 0.5]
    plot_goodput(result, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size < 200_000


def test_rounds_end_with_each_ratios_median_and_range(capsys):
    from kvserve.benchmarks.peers.table import median_ratios, print_median_ratios

    def ratio(tok_s, ttft99):
        return {"output_tokens_per_s": tok_s, "ttft_p50": 1.0, "ttft_p99": ttft99, "itl_p50": 0.5}

    nan = float("nan")
    rounds = [{"vllm": [ratio(1.2, 0.9)], "llama.cpp": [ratio(3.0, 0.4)]},
              {"vllm": [ratio(1.6, nan)]},  # llama.cpp failed in this round: no median for it
              {"vllm": [ratio(1.4, 1.1)]}]
    got = median_ratios(rounds)
    assert list(got) == ["vllm"]
    assert got["vllm"][0]["output_tokens_per_s"] == {"median": 1.4, "low": 1.2, "high": 1.6}
    assert got["vllm"][0]["ttft_p99"] == {"median": 1.0, "low": 0.9, "high": 1.1}  # the NaN left out
    assert print_median_ratios([{"kind": "concurrency", "value": 32}], rounds) == got
    out = capsys.readouterr().out
    assert "median of 3 rounds" in out and "1.40x (1.20-1.60)" in out and "1.00x (0.90-1.10)" in out


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        compare.main(["--systems", "kvserve", "--rounds", "0", "--peers-dir", str(tmp_path)])
