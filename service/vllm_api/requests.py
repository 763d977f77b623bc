"""vLLM ``GenerateRequest`` -> kvserve's engine request: the field-by-field mapping and the
refusals. ``ValueError`` (INVALID_ARGUMENT) names the field a request sets that kvserve does not
have; ``NotImplementedError`` (UNIMPLEMENTED) is for multimodal input.

How the upstream protocol's fields map (docs/reference/vllm-engine-api.md has the table):
proto3 gives unset scalars the value zero, so a zero ``top_p`` or ``repetition_penalty`` (never a
valid value) and an unset ``temperature`` take the model's recommended value
(generation_config.json), else kvserve's default, as for kvserve's own API; ``n`` 0 is 1;
``logprobs`` 0 asks for the chosen token's log-probability alone (vLLM's meaning, where kvserve's
own API uses 0 for none).

This runs on the event loop: as in service/api/validation.py, ``tokenized.input_ids`` is sized
with ``len()`` (free) before any of it becomes a Python list, a prompt of ``max_model_len`` ids or
more (after ``truncate_prompt_tokens``) is refused there, and only the ids kept are copied.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvserve.engine.sampling_params import SamplingParams
from kvserve.vllm import vllm_engine_pb2 as pb

MAX_REQUEST_ID_CHARS = 256


@dataclass
class VllmRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    logprobs: int | None  # alternatives per token the caller asked for (None: no logprobs)
    truncate: int | None  # keep this many last prompt tokens (already resolved from -1)
    stream: bool


def parse_request(req: pb.GenerateRequest, vocab_size: int, max_model_len: int,
                  defaults: dict | None = None) -> VllmRequest:
    """Check and convert; raises ValueError / NotImplementedError naming the field."""
    if req.HasField("mm_inputs") or len(req.extra_mm_inputs) or req.HasField("media_refs"):
        field = "mm_inputs" if req.HasField("mm_inputs") else (
            "extra_mm_inputs" if len(req.extra_mm_inputs) else "media_refs")
        raise NotImplementedError(f"{field}: kvserve serves text-only models; multimodal input is not "
                                  "supported")
    for field in ("kv_transfer_params", "kv_transfer_params_json"):
        if req.HasField(field):
            raise ValueError(f"{field}: kvserve has no prefill/decode disaggregation (KV transfer)")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise ValueError(f"data_parallel_rank: kvserve runs one data-parallel rank (0), "
                         f"got {req.data_parallel_rank}")
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    sp = req.sampling_params
    truncate = None
    if sp.HasField("truncate_prompt_tokens"):
        k = sp.truncate_prompt_tokens
        if k == -1:
            k = max_model_len
        if k < 1:
            raise ValueError(f"sampling_params.truncate_prompt_tokens: -1 (the model's maximum) or >= 1, "
                             f"got {k}")
        truncate = k
    prompt = _prompt(req, vocab_size, max_model_len, truncate)
    logprobs = _logprobs(sp)
    params = sampling_params(sp, defaults, logprobs).validate(vocab_size)
    return VllmRequest(request_id, prompt, params, logprobs, truncate, req.stream)


def _prompt(req: pb.GenerateRequest, vocab_size: int, max_model_len: int,
            truncate: int | None) -> str | list[int]:
    """The text, or the token ids (the last ``truncate`` of them when that is set)."""
    which = req.WhichOneof("input")
    if which is None:
        raise ValueError("input: give one of tokenized or text")
    if which == "text":
        if not req.text:
            raise ValueError("text: must not be empty")
        return req.text
    given = req.tokenized.input_ids
    n = len(given)
    if not n:
        raise ValueError("tokenized.input_ids: must not be empty")
    kept = n if truncate is None else min(n, truncate)
    if kept >= max_model_len:
        raise ValueError(f"tokenized.input_ids: {kept} ids leave no room for a completion: a prompt must be "
                         f"shorter than max_model_len ({max_model_len} tokens)")
    ids = list(given) if kept == n else given[n - kept:]  # a slice is a list already
    top = max(ids)  # one pass in C, not a Python loop per id
    if top >= vocab_size:
        raise ValueError(f"tokenized.input_ids: id {top} is outside the vocabulary [0, {vocab_size})")
    return ids


def _logprobs(sp: pb.SamplingParams) -> int | None:
    if sp.HasField("prompt_logprobs"):
        raise ValueError("sampling_params.prompt_logprobs: kvserve does not return prompt log-probabilities")
    if not sp.HasField("logprobs"):
        return None
    if sp.logprobs < 0:
        raise ValueError(f"sampling_params.logprobs: -1 (the whole vocabulary) is not supported; "
                         f"give 0..20, got {sp.logprobs}")
    return sp.logprobs


def sampling_params(sp: pb.SamplingParams, defaults: dict | None, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for the upstream message (see the module's docstring)."""
    if sp.logit_bias:
        raise ValueError("sampling_params.logit_bias: not supported by kvserve's sampler")
    if sp.HasField("seed") and sp.seed < 0:
        raise ValueError(f"sampling_params.seed: must be >= 0, got {sp.seed}")
    kw = dict(defaults or {})
    if sp.HasField("temperature"):
        kw["temperature"] = sp.temperature
    for name in ("top_p", "repetition_penalty"):  # zero is never valid: it means unset
        if getattr(sp, name):
            kw[name] = getattr(sp, name)
    for name in ("top_k", "min_p", "frequency_penalty", "presence_penalty", "min_tokens"):
        if getattr(sp, name) or name not in kw:
            kw[name] = getattr(sp, name)
    kw.update(
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens, n=sp.n or 1,
        seed=sp.seed if sp.HasField("seed") else None,
        # the engine always reports the chosen token with its alternatives: at least one is asked
        logprobs=0 if logprobs is None else max(logprobs, 1),
    )
    kw.update(_constraint(sp))
    return SamplingParams(**kw)


def _constraint(sp: pb.SamplingParams) -> dict:
    which = sp.WhichOneof("constraint")
    if which is None:
        return {}
    if which == "structural_tag":
        raise ValueError("sampling_params.structural_tag: not supported; use json_schema, regex, grammar, "
                         "json_object or choice")
    if which == "choice":  # set but empty would otherwise read as no constraint at all
        if not sp.choice.choices:
            raise ValueError("sampling_params.choice.choices: must name at least one string")
        return {"choice": list(sp.choice.choices)}
    return {which: getattr(sp, which)}
