"""Per-request sampling parameters: the Python mirror of the gRPC ``SamplingParams``.

Field names and defaults are the API contract (``proto/kvserve/v1/llm.proto``). ``validate()`` raises
``ValueError`` naming the field and the limit; the service maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.engine.constraints import check_structured

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
MAX_DRAFT_TOKENS = 16
# Below this a temperature is greedy: dividing logits by it would overflow float32 (1e-38 gave
# inf logits and then token 0 forever), and long before that the draw is an argmax anyway.
GREEDY_TEMPERATURE = 1e-5
# the sampler computes in float32: a larger temperature would become inf and turn masked
# logits into NaN (-inf / inf)
MAX_TEMPERATURE = 3.0e38
# Outside this range the penalty overflows a logit (x / 1e-38 = inf) or flattens the row;
# HF and vLLM users keep it near 1.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # draws keyed by (seed + choice index, position): see llm.proto for the promise
    # None = as many as fit: up to max_model_len (and the whole KV cache), as vLLM's API does
    max_tokens: int | None = None
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # [0.01, 100]; 1 = off (applied over prompt and output tokens)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logprobs: int = 0  # top-N alternatives per token, 0 = none
    skip_special_tokens: bool = True
    # structured output, at most one of the five (engine/constraints.py; engine/structured/grammar.py)
    json_schema: str | None = None  # a JSON Schema document
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # EBNF / GBNF
    choice: list[str] = field(default_factory=list)  # exactly one of these strings
    n: int = 1  # completions of the prompt, [1, MAX_N]; choice i samples with seed + i
    # only requests with the same salt share prefix-cache blocks (engine/core/block_manager.py)
    cache_salt: str | None = None
    # speculative decoding, where the server has it on: "auto" (the server decides per step) or "off"
    speculative: str = "auto"
    max_draft_tokens: int | None = None  # the most draft tokens per step for this request (0 = none)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError (message names the field and the limit) on any bad value."""
        _finite("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_TEMPERATURE:g} = greedy), "
                f"got {self.temperature}"
            )
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (unset = up to max_model_len), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise ValueError("stop: stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop: each stop string is at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids: id {t} is outside the vocabulary [0, {vocab_size})")
        _finite("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _finite(name, v)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.cache_salt is not None and len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(
                f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}"
            )
        if self.speculative not in ("auto", "off"):
            raise ValueError(f"speculative must be 'auto' or 'off', got {self.speculative!r}")
        if self.max_draft_tokens is not None and not 0 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"max_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.max_draft_tokens}")
        check_structured(self)
        return self


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
