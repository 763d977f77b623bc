"""Engine configuration: one frozen dataclass whose field names are the CLI flags
(``--max-num-seqs`` -> ``max_num_seqs``) and the keywords of ``LLM(...)``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_MODEL_LEN = 8192  # the cap on a model's own limit when max_model_len is not given
SPECULATIVE_MODES = ("off", "ngram", "grammar", "all")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 32
QUANTIZATIONS = ("int8", "int4")  # quantized weights, CPU (engine/layers/quantization.py)
SCHEDULING_POLICIES = ("fair", "fcfs")  # engine/tenancy/shares.py
MAX_TENANT_ROW_COST = 0.5  # engine/tenancy/rows.py
MAX_TENANT_LINGER_MS = 60_000.0
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: CPU (engine/layers/attention/kv_quant.py)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the default (resolve_max_num_batched_tokens)
    max_step_time_ms: float | None = None  # None: by device (resolve_max_step_time); 0: no time bound
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    block_size: int = 16
    kv_cache_memory: float = 1.0  # GiB for the KV cache on CPU
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory-based sizing
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    threads: int | None = None  # CPU intra-op threads per rank; None: the usable CPUs / local ranks
    quantization: str | None = None  # "int8" / "int4": quantized weights on the CPU; None: in dtype
    kv_cache_dtype: str = "auto"  # "int8": an int8 KV cache on the CPU; auto: the model's dtype
    # structured output: constraints compile in child processes, each within a time budget
    grammar_compile_timeout: float = 10.0  # seconds
    grammar_compile_workers: int = 2
    # tensor parallel across machines (torch.distributed); see engine/distributed/channels.py
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port is chosen
    tp_channel: str = "auto"  # "shm" (one machine), "dist" (torch.distributed), "auto"
    # speculative decoding without a draft model (engine/spec_decode/): "ngram" (prompt lookup; a
    # constrained request's cut to its grammar), "grammar" (a constraint's forced tokens), "all" or "off"
    speculative: str = "off"
    num_speculative_tokens: int = 5  # the most draft tokens a sequence verifies in one step
    prompt_lookup_min: int = 2  # shortest suffix n-gram the drafter matches
    prompt_lookup_max: int = 5  # longest, tried first
    # sharing the engine between tenants (engine/tenancy/shares.py): "fair" (tokens served per tenant,
    # priority, deadlines) or "fcfs" (arrival order); caps per tenant (None: none); weights as
    # "TENANT=W,..." with tenants as the engine sees them (the server hashes the names it is given)
    scheduling_policy: str = "fair"
    max_running_per_tenant: int | None = None
    max_queued_per_tenant: int | None = None
    tenant_weights: str | None = None
    # while a tenant under its share has work (or had, tenant_linger_ms ago), the decode rows of tenants
    # over theirs are cut to keep their tokens per second within this fraction of full steps (0: off)
    tenant_row_cost: float = 0.05
    tenant_linger_ms: float = 250.0
    # a JSON line per step and per first token appended to this file (engine/tenancy/step_trace.py); None: off
    step_trace: str | None = None

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("tp_channel", self.tp_channel, ("auto", "shm", "dist"))
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("speculative", self.speculative, SPECULATIVE_MODES)
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        self.weights()  # raises on a malformed list
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max}) <= {MAX_PROMPT_LOOKUP}")
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS)
        positive = ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "nnodes",
                    "grammar_compile_workers", "max_running_per_tenant", "max_queued_per_tenant")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence needs a token of budget per step, or some would starve
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_step_time_ms is not None and self.max_step_time_ms < 0:
            raise ValueError(f"max_step_time_ms must be >= 0 (0: no bound), got {self.max_step_time_ms}")
        if not 0 <= self.tenant_row_cost <= MAX_TENANT_ROW_COST:
            raise ValueError(f"tenant_row_cost must be in [0, {MAX_TENANT_ROW_COST}], "
                             f"got {self.tenant_row_cost}")
        if not 0 <= self.tenant_linger_ms <= MAX_TENANT_LINGER_MS:
            raise ValueError(f"tenant_linger_ms must be in [0, {MAX_TENANT_LINGER_MS:.0f}], "
                             f"got {self.tenant_linger_ms}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 s, got {self.grammar_compile_timeout}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keywords; an unknown keyword is an error that lists the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(names)}")
        return cls(**kwargs)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def weights(self) -> dict[str, float]:
        """``tenant_weights`` as a dict; ValueError naming the entry when one is malformed."""
        return parse_weights(self.tenant_weights or "", "tenant_weights")


def parse_weights(text: str, field: str) -> dict[str, float]:
    """"a=3,b=1" -> {"a": 3.0, "b": 1.0}: each weight a finite number > 0, each name once."""
    weights: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, value = entry.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{field}: each entry is TENANT=WEIGHT with a weight > 0, got {entry!r}")
        if name in weights:
            raise ValueError(f"{field}: tenant {name!r} is given twice")
        weights[name] = weight
    return weights


# A step's token budget when none is given, on every device: vLLM's 2,048. On the 2-core CPU
# 512 was the default while nothing else bounded a step's time (it gave a shorter first-token
# latency and worst gap than 2,048 then); since the step time bound, which bounds the first steps
# after start-up too and stretches while a burst of prompts waits beside many streams
# (engine/core/step_time.py), 2,048 served bursts better at equal throughput and light-load
# latency (docs/performance/tuning.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_max_num_batched_tokens(config: EngineConfig) -> int:
    """The one token-budget rule, used by the engine before it starts its runners: the configured
    value; unset, ``DEFAULT_MAX_NUM_BATCHED_TOKENS``, and never less than ``max_num_seqs`` (every running
    sequence needs a token of budget in each step)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs)


# A step's time bound by device when --max-step-time-ms is unset. On the CPU a step's time is the
# gap every running stream sees between two tokens, and a chunk late in a long prompt costs
# several times one at its start; 500 ms is about a full 512-token step at short contexts, so the
# bound bites only where chunks get dearer than that (docs/performance/tuning.md). GPUs: no bound.
DEFAULT_MAX_STEP_TIME_MS = {"cpu": 500.0}


def resolve_max_step_time(config: EngineConfig, device_type: str) -> float | None:
    """Seconds a step may take (the scheduler cuts prefill chunks to fit), or None for no bound:
    the configured milliseconds (0: none); unset, the device's default."""
    ms = config.max_step_time_ms
    if ms is None:
        ms = DEFAULT_MAX_STEP_TIME_MS.get(device_type, 0.0)
    return ms / 1000 if ms > 0 else None


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """The one max_model_len rule, used by the engine (scheduler limits) and by every model
    runner (warm-up, graph tables): the configured value, at most the model's
    ``max_position_embeddings``; unset, that limit capped at ``DEFAULT_MAX_MODEL_LEN``."""
    limit = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if config.max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings ({limit})"
        )
    return config.max_model_len


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
