"""The ``kvserve serve`` subcommand: its flags and what it runs. ``kvserve.cli`` gathers it
with the other subcommands.

The engine flags of ``serve`` are derived from ``EngineConfig``'s fields (``max_num_seqs`` ->
``--max-num-seqs``), so a new engine option is a new flag with no change here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import types
import typing

from kvserve.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_MODES,
    EngineConfig,
)
from kvserve.engine.frontend.async_engine import DEFAULT_MAX_QUEUE, DEFAULT_STEP_TIMEOUT_S
from kvserve.logs import LOG_FORMATS, configure_logging
from kvserve.service.api.validation import CACHE_SALT_SOURCES, DEFAULT_CACHE_SALT_HEADER, CacheSalting
from kvserve.service.guards.limits import add_limit_flags, connection_limits, stream_limits
from kvserve.service.guards.security import add_security_flags, security_settings
from kvserve.service.health import HEALTH_PORT_ENV

ALIASES = {"tensor_parallel_size": ["--tp"]}
CHOICES = {
    "dtype": DTYPES,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "tp_channel": ("auto", "shm", "dist"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATIONS,
    "speculative": SPECULATIVE_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
}
HELP = {
    "model": "'default' (the bundled SmolLM2-135M-Instruct), a Hugging Face directory or a .gguf file",
    "dtype": ("weights and activations: auto = bfloat16 on GPUs, on CPUs with native bf16 and where the CPU "
              "kernels' bf16 GEMM is built (AVX2 with FMA), else float32"),
    "device": "where the model runs: auto = cuda when available, else cpu",
    "attention_backend": "auto = torch on CPU; on CUDA flash-attn when it imports and --block-size is a "
                         "multiple of 256, else triton",
    "nnodes": "machines taking part in tensor parallelism (workers join with `kvserve worker`)",
    "node_rank": "this machine's index among --nnodes (the leader is 0)",
    "master_addr": "address of the leader's torch.distributed rendezvous",
    "master_port": "port of the rendezvous (default: one the OS picks; fix it when --nnodes > 1)",
    "tp_channel": "how the leader sends steps to workers: shm (one machine), dist (torch.distributed); "
                  "auto picks",
    "tensor_parallel_size": "tensor-parallel ranks",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decode tokens); default: 2048 "
                              "(docs/performance/tuning.md)",
    "max_step_time_ms": "time bound of one step, the gap running streams see between tokens: prefill chunks "
                        "shrink so that a step's predicted time (a model fitted to the steps that ran) stays "
                        "under it; beside many running streams it stretches until their decodes are a tenth "
                        "of a step that prefills (at most 4x), and a step that prefills while prompts wait "
                        "is at least 5x the fitted fixed part of a step (large models on the CPU: "
                        "docs/performance/tuning.md); 0 = no bound; default: 500 on the CPU, none on a GPU",
    "max_model_len": "longest prompt + completion (default: the model's, capped at 8192)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "GiB for the KV cache on CPU",
    "gpu_memory_utilization": "share of GPU memory the engine may use",
    "num_kv_blocks": "KV cache blocks (overrides the memory-based sizing)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "enforce_eager": "no CUDA graphs",
    "seed": "seed for requests that bring none",
    "threads": "CPU intra-op threads per rank (default: the CPUs this process may use, after affinity "
               "and cgroup quota, shared among the tensor-parallel ranks on this machine)",
    "quantization": "quantized weights on the CPU: int8 = int8 projections and LM head; int4 = 4-bit "
                    "projections (a float16 scale and min per 32 inputs, as GGUF's Q4_1) and an int8 LM "
                    "head; on AVX512-VNNI and AVX2 CPUs small decode steps quantize activations too, per "
                    "32 values (default: weights in --dtype)",
    "grammar_compile_timeout": "seconds one structured-output constraint may take to compile; a longer "
                               "compile is stopped and its request refused (INVALID_ARGUMENT)",
    "grammar_compile_workers": "structured-output constraints compiled at once, each in a child process "
                               "(started at the first constrained request)",
    "kv_cache_dtype": "auto = the model's dtype; int8 = an int8 KV cache on the CPU (one scale per token "
                      "and KV head): about half of bfloat16's bytes per token, so about twice the tokens "
                      "in --kv-cache-memory",
    "speculative": "speculative decoding without a draft model: ngram = drafts from each request's own "
                   "prompt and output (prompt lookup), verified by sampling each drafted position and "
                   "keeping the drafts while they match, so the tokens are those of plain decoding; the "
                   "draft length is chosen per step from step costs measured at start-up "
                   "(docs/serving/speculative.md); grammar = a structured-output request's forced "
                   "tokens (the text its constraint leaves no choice about); all = both, composed "
                   "(n-gram drafts of a constrained request are cut to what its grammar allows); "
                   "off = none",
    "num_speculative_tokens": "most draft tokens a request verifies in one step (--speculative not off)",
    "prompt_lookup_min": "shortest suffix n-gram the prompt-lookup drafter matches",
    "prompt_lookup_max": "longest suffix n-gram the prompt-lookup drafter matches (tried first)",
    "scheduling_policy": "fair = tenants (--cache-salt-from) share the engine by tokens served, priority "
                         "orders a tenant's work, a request that cannot start or finish before its "
                         "deadline is refused (DEADLINE_EXCEEDED); fcfs = arrival order, no deadline refusal "
                         "(docs/serving/tenants.md)",
    "max_running_per_tenant": "most sequences of one tenant running at once (choices count, as in "
                              "--max-num-seqs); more wait (default: no cap)",
    "max_queued_per_tenant": "most requests of one tenant waiting to run; beyond it RESOURCE_EXHAUSTED "
                             "(default: no cap)",
    "tenant_weights": "NAME=W,...: tenants' shares by weight under the fair policy (default: every weight "
                      "1); NAME is the API key or --cache-salt-header value, as --cache-salt-from says",
    "tenant_row_cost": "fair policy: while a tenant under its share of the slots has work, tenants over "
                       "theirs decode fewer rows a step: a quarter while its first token is due, else the "
                       "fewest that lose at most this fraction of their tokens per second by the step "
                       "time model (at least half); in [0, 0.5], 0 = no cut (docs/serving/tenants.md)",
    "tenant_linger_ms": "fair policy: a tenant counts as present this long after its last request ended "
                        "(its next one should not land in a long step); in [0, 60000]",
    "step_trace": "append a JSON line per engine step (its kind, rows and prefill tokens per tenant, "
                  "predicted and actual seconds) and per first token to this file: which steps a request "
                  "waited on (docs/serving/tenants.md; default: none)",
}


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model over gRPC", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_engine_flags(serve.add_argument_group("engine"))
    s = serve.add_argument_group("service")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    s.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="most requests admitted but not yet running; beyond it RESOURCE_EXHAUSTED")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted")
    s.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds the engine core may stay silent (one step, or between idle heartbeats) "
                        "before the engine is declared dead (a hung or stopped tensor-parallel worker)")
    s.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="Stream sends a message per N new tokens (the first token, the last and an "
                        "error at once): fewer messages and wake-ups per token for a burstier stream; "
                        "1 = every token at once (default)")
    s.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="exit with status 1 once the engine died and its requests were failed "
                        "(--no-exit-on-engine-failure: stay up, NOT_SERVING)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--cache-salt-from", default="none", choices=CACHE_SALT_SOURCES,
                   help="isolate the prefix cache by caller: api-key = by the bearer credential in "
                        "`authorization`, header = by the value of --cache-salt-header; only requests "
                        "with the same salt share cached blocks (docs/deployment/security.md)")
    s.add_argument("--cache-salt-header", default=DEFAULT_CACHE_SALT_HEADER, metavar="KEY",
                   help="the metadata key naming the tenant, with --cache-salt-from header")
    add_security_flags(serve)
    add_limit_flags(serve)
    s.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="log lines as text, or as JSON objects (one per line) for a log pipeline")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
                        "default: no metrics endpoint)")
    s.add_argument("--health-port", type=int, default=None,
                   help="also answer grpc.health.v1 (and nothing else) in plaintext on HOST:PORT, for "
                        "probes that cannot do TLS or mutual TLS (Docker HEALTHCHECK, Kubernetes gRPC "
                        f"probes; 0: any free port; default: ${HEALTH_PORT_ENV}, else none)")
    s.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel:4317 "
                        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; neither: no tracing)")
    add_mesh_flags(serve.add_argument_group("mesh (docs/deployment/mesh.md)"))
    serve.set_defaults(func=cmd_serve)


def add_mesh_flags(m) -> None:
    """Connection age and KV-cache events: what routers in front of many replicas use."""
    m.add_argument("--max-connection-age", type=float, default=None, metavar="SECONDS",
                   help="send GOAWAY to a connection after this many seconds (calls in flight get as long "
                        "again), so clients balancing over DNS reconnect and reach new replicas "
                        "(default: never)")
    m.add_argument("--kv-events", action="store_true",
                   help="publish KV-cache events on the SubscribeKvEvents RPC (on by itself with "
                        "--kv-events-endpoint)")
    m.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ADDRESS",
                   help="also publish them in vLLM's format on a ZeroMQ PUB socket, e.g. tcp://*:5557 "
                        "(* binds --host; the events carry prompt token ids: name 0.0.0.0 to open them to "
                        "every interface; default: none)")
    m.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ADDRESS",
                   help="answer replay requests for the last 10000 batches on a ZeroMQ ROUTER socket, "
                        "e.g. tcp://*:5558 (* binds --host, as above; default: none)")
    m.add_argument("--kv-events-topic", default=None,
                   help="the ZeroMQ topic (default: kv@POD@MODEL, POD from $POD_NAME, else the host name)")


def mesh_settings(args: argparse.Namespace) -> dict:
    """ServeSettings' keywords for the mesh flags; ValueError naming a bad one."""
    from kvserve.service.server import KvEventSettings

    if args.max_connection_age is not None and not args.max_connection_age > 0:
        raise ValueError(f"--max-connection-age must be > 0 seconds, got {args.max_connection_age}")
    for flag, value in (("--kv-events-endpoint", args.kv_events_endpoint),
                        ("--kv-events-replay-endpoint", args.kv_events_replay_endpoint)):
        if value is not None and "://" not in value:
            raise ValueError(f"{flag} must be a ZeroMQ address such as tcp://*:5557, got {value!r}")
    kv = KvEventSettings(args.kv_events, args.kv_events_endpoint, args.kv_events_replay_endpoint,
                         args.kv_events_topic)
    return {"max_connection_age": args.max_connection_age, "kv_events": kv}


def _env_port(name: str) -> int | None:
    """A port number from the environment (None when unset); a bad value stops ``serve`` naming it."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"kvserve serve: ${name} must be a port number, got {value[:64]!r}") from None


def _check_port(label: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise SystemExit(f"kvserve serve: {label} must be in [0, 65535], got {value}")


def add_engine_flags(group) -> None:
    """One flag per EngineConfig field, typed and defaulted from the dataclass."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        names = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
        kind = _base_type(hints[f.name])
        help_text = HELP[f.name]  # every field has one (tests/test_cli.py)
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        else:
            group.add_argument(*names, dest=f.name, type=kind, default=f.default, choices=CHOICES.get(f.name),
                               help=help_text)


def _base_type(hint) -> type:
    """``int | None`` -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.service.guards.security import server_credentials
    from kvserve.service.server import ServeSettings, serve

    configure_logging(args.log_level, args.log_format)
    if args.max_queue < 1:
        raise SystemExit(f"kvserve serve: --max-queue must be >= 1, got {args.max_queue}")
    _check_port("--metrics-port", args.metrics_port)
    if args.health_port is None:
        args.health_port = _env_port(HEALTH_PORT_ENV)
    _check_port(f"--health-port (or ${HEALTH_PORT_ENV})", args.health_port)
    if args.drain_timeout < 0:
        raise SystemExit(f"kvserve serve: --drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.step_timeout <= 0:
        raise SystemExit(f"kvserve serve: --step-timeout must be > 0, got {args.step_timeout}")
    if args.stream_interval < 1:
        raise SystemExit(f"kvserve serve: --stream-interval must be >= 1, got {args.stream_interval}")
    try:
        salting = CacheSalting(args.cache_salt_from, args.cache_salt_header)
        config = engine_config(args)
        config = config.replace(tenant_weights=salting.tenant_weights(config.tenant_weights))
        settings = ServeSettings(args.host, args.port, args.max_queue, args.drain_timeout,
                                 step_timeout=args.step_timeout, stream_interval=args.stream_interval,
                                 exit_on_engine_failure=args.exit_on_engine_failure,
                                 log_level=args.log_level, metrics_port=args.metrics_port,
                                 health_port=args.health_port,
                                 otlp_endpoint=args.otlp_endpoint,
                                 security=security_settings(args), limits=stream_limits(args),
                                 connections=connection_limits(args),
                                 cache_salting=salting,
                                 **mesh_settings(args))
        credentials = server_credentials(settings.security)  # unreadable or non-PEM: refused before loading
    except ValueError as e:
        raise SystemExit(f"kvserve serve: {e}") from None
    try:
        return asyncio.run(serve(config, settings, credentials))
    except OSError as e:
        logging.getLogger("kvserve.service").error("%s", e)
        return 1
