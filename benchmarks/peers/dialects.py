"""One streamed request in each peer's own dialect, timed into the serving benchmark's ``Trace``:
vLLM's OpenAI ``/v1/completions`` and llama-server's ``/completion``, both Server-Sent Events.

Every system gets the same sampling, spelled out (``sampling_fields``): temperature T and nothing
else (top-p 1, no top-k, min-p 0, no repetition penalty), so that no server's own defaults (the
bundled model's top-p 0.9 in kvserve, llama-server's top-k 40 and repeat penalty) differ. Every
request ignores EOS, so each makes exactly its output length. A token is timed when the event
that carries it is read: vLLM sends one per token (``token_ids`` counts them where it sends them,
and the closing ``usage`` checks the count), llama-server's events carry ``tokens``.
"""

from __future__ import annotations

import contextlib
import json
import time

from kvserve.benchmarks.peers.sse import HTTPError, sse_events
from kvserve.benchmarks.serving.load import Request, Trace

VLLM_MODEL_NAME = "kvserve-peer"  # the --served-model-name the harness starts vLLM with


def sampling_fields(temperature: float) -> dict:
    """kvserve's SamplingParams fields for plain temperature sampling (greedy at 0)."""
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def vllm_body(req: Request, temperature: float, model: str = VLLM_MODEL_NAME) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def llama_body(req: Request, temperature: float) -> dict:
    return {"prompt": req.prompt, "n_predict": req.max_tokens, "temperature": temperature, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "ignore_eos": True, "stream": True,
            "cache_prompt": True, "return_tokens": True}


async def stream_vllm(host: str, port: int, req: Request, temperature: float,
                      model: str = VLLM_MODEL_NAME) -> Trace:
    """One ``/v1/completions`` stream. A chunk of choices carries one token (or its ``token_ids``);
    the usage chunk at the end says how many there were: a count short of it is made up at the
    last arrival (tokens that came together), a count over it trimmed."""
    tr = Trace(sent=time.perf_counter())
    times = tr.token_times
    usage = None
    try:
        async with contextlib.aclosing(sse_events(host, port, "/v1/completions",
                                                  vllm_body(req, temperature, model))) as events:
            async for event in events:
                now = time.perf_counter()
                data = event.get("data")
                if data is None or data == "[DONE]":
                    continue
                msg = json.loads(data)
                if msg.get("error") or msg.get("object") == "error":
                    tr.error = _error_name(msg)
                    break
                for choice in msg.get("choices") or ():
                    ids = choice.get("token_ids")
                    times.extend([now] * (len(ids) if isinstance(ids, list) else 1))
                if msg.get("usage"):
                    usage = msg["usage"].get("completion_tokens")
    except (OSError, HTTPError, ValueError) as e:
        tr.error = _exception_name(e)
    if tr.error is None and isinstance(usage, int) and times:
        del times[usage:]
        times.extend([times[-1]] * (usage - len(times)))
    tr.end = time.perf_counter()
    return tr


async def stream_llama(host: str, port: int, req: Request, temperature: float) -> Trace:
    """One ``/completion`` stream: each event's ``tokens`` are its tokens (one if it has none and
    some ``content``); the event with ``stop: true`` is the last."""
    tr = Trace(sent=time.perf_counter())
    times = tr.token_times
    try:
        async with contextlib.aclosing(sse_events(host, port, "/completion", llama_body(req, temperature))) \
                as events:
            async for event in events:
                now = time.perf_counter()
                if "error" in event:  # llama-server's own "error: {...}" line
                    tr.error = _error_name(_json_or_text(event["error"]))
                    break
                if event.get("data") is None:
                    continue
                msg = json.loads(event["data"])
                if msg.get("error"):
                    tr.error = _error_name(msg)
                    break
                tokens = msg.get("tokens")
                n = len(tokens) if isinstance(tokens, list) else int(bool(msg.get("content")))
                times.extend([now] * n)
                if msg.get("stop"):
                    break
    except (OSError, HTTPError, ValueError) as e:
        tr.error = _exception_name(e)
    tr.end = time.perf_counter()
    return tr


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {"error": text}


def _error_name(msg: dict) -> str:
    """A short error label for the report's error counts (``HTTP_503``, a server's error type)."""
    err = msg.get("error", msg)
    if isinstance(err, dict):
        return str(err.get("type") or err.get("code") or "error")
    return str(msg.get("type") or "error")


def _exception_name(e: Exception) -> str:
    return f"HTTP_{e.status}" if isinstance(e, HTTPError) else type(e).__name__
