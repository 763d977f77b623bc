"""deploy/mesh/*.yaml: the gateway (SMG) and the Inference Extension's pool, valid Kubernetes
objects (strict schemas for the built-in kinds) and consistent with the servers they front: the
gateway's args parse with smg's own parser and find the kvserve pods on their gRPC port, the
pool selects those pods on the same port, and the endpoint picker reads metric names kvserve
exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvserve.cli import build_parser
from kvserve.engine.frontend.engine_state import ServerStats
from kvserve.engine.spec_decode.speculator import speculation_stats
from kvserve.service.telemetry.metrics import SnapshotCollector

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MESH = [d for p in sorted((ROOT / "deploy" / "mesh").glob("*.yaml")) for d in load(p)]
(KVSERVE,) = [d for d in load(ROOT / "deploy" / "deployment.yaml") if d["kind"] == "Deployment"]


def one(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in MESH if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def kvserve_args():
    (c,) = KVSERVE["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args(c["args"][1:])


def kvserve_pod_labels() -> dict:
    return KVSERVE["spec"]["template"]["metadata"]["labels"]


def test_every_builtin_object_passes_the_strict_schema():
    builtin = [d for d in MESH if d["apiVersion"] in ("v1", "apps/v1", "rbac.authorization.k8s.io/v1")]
    assert {d["kind"] for d in builtin} == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service",
                                            "ConfigMap"}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_gateway_runs_cache_aware_over_the_kvserve_pods():
    from smg.launch_router import parse_router_args

    (c,) = one("Deployment", "smg")["spec"]["template"]["spec"]["containers"]
    assert c["args"][:2] == ["smg", "launch"]
    args = parse_router_args(c["args"][2:])  # smg's own parser: exits (fails the test) on a bad flag
    assert args.policy == "cache_aware" and args.service_discovery
    assert args.selector.items() <= kvserve_pod_labels().items()
    serve = kvserve_args()
    assert args.service_discovery_port == serve.port and args.block_size == serve.block_size
    # the replicas publish the events the cache-aware policy follows
    assert serve.kv_events_endpoint is not None or serve.kv_events
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == args.port and ports["health"] == args.health_check_port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "health"
    service = one("Service", "smg")
    assert service["spec"]["selector"].items() <= one("Deployment", "smg")["spec"]["template"]["metadata"][
        "labels"].items()
    binding = one("RoleBinding")
    assert binding["subjects"][0]["name"] == one("ServiceAccount")["metadata"]["name"]


def test_the_inference_pool_selects_the_kvserve_pods_on_their_grpc_port():
    pool = one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= kvserve_pod_labels().items()
    assert pool["spec"]["targetPorts"] == [{"number": kvserve_args().port}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"  # vLLM's gRPC engine protocol


def test_the_endpoint_picker_reads_metric_names_kvserve_exports():
    config = yaml.safe_load(one("ConfigMap", "kvserve-epp-config")["data"]["config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    (engine,) = plugins["core-metrics-extractor"]["engineConfigs"]
    assert kvserve_pod_labels()["llm-d.ai/engine-type"] == engine["name"]
    assert plugins["metrics-data-source"]["port"] == kvserve_args().metrics_port
    stats = ServerStats(model="m", device="cpu", dtype="float32", tp_size=1, attention_backend="torch",
                        num_running=0, num_waiting=0, num_queued=0, max_queue=8, requests_rejected=0,
                        kv_blocks_total=8, kv_blocks_free=8, kv_block_size=16, kv_cache_dtype="float32",
                        prefix_cache_hit_rate=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0, requests_finished=0, requests_aborted=0, prompt_tokens_total=0,
                        generation_tokens_total=0, uptime_s=0.0,
                        **speculation_stats(None))  # speculative decoding's fields, zeros when it is off
    exported = {f.name for f in SnapshotCollector("m", lambda: stats).collect()}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert engine[key].split("{")[0] in exported, key
    refs = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert refs <= plugins.keys()
