"""deploy/*.yaml: valid Kubernetes objects (kubernetes-validate's schemas, strict), and consistent
with the server they run: the container's args parse as `kvserve serve` flags, the ports and
probes point where the server listens, the probes use the standard gRPC health service under
the names the server reports, the startup probe waits long enough for a model load, and the
termination grace period outlasts the drain."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from kvserve.cli import build_parser
from kvserve.clients.messages import SERVICE_NAME
from kvserve.service.health import HEALTH_SERVICES

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"
MIN_STARTUP_S = 300  # a large model on a cold node takes minutes to load
SERVER_STOP_S = 10  # after the drain: server.stop(grace=5) and the engine core's exit


def documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def of_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


@pytest.fixture(scope="module")
def deployment() -> dict:
    (dep,) = of_kind("Deployment")
    return dep


@pytest.fixture(scope="module")
def container(deployment) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def serve_args(container):
    assert container["args"][:2] == ["kvserve", "serve"]
    return build_parser().parse_args(container["args"][1:])  # exits (fails the test) on a bad flag


def ports(container) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_every_builtin_object_passes_the_strict_schema():
    docs = [d for d in documents() if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_would_catch_a_misspelled_field(deployment):
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_container_ports_are_the_servers(container, serve_args, deployment):
    assert serve_args.host == "0.0.0.0"  # reachable from other pods
    assert ports(container) == {"grpc": serve_args.port, "metrics": serve_args.metrics_port,
                                "health": serve_args.health_port,
                                "kv-events": int(serve_args.kv_events_endpoint.rsplit(":", 1)[1])}
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == serve_args.metrics_port
    assert notes["prometheus.io/path"] == "/metrics"


def test_probes_use_the_standard_grpc_health_service(container, serve_args):
    # the plaintext health port: the kubelet's gRPC probe cannot do TLS
    assert serve_args.health_port not in (None, serve_args.port)
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[name]["grpc"]
        assert probe["port"] == serve_args.health_port, name
        assert probe["service"] in HEALTH_SERVICES, name
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def budget(probe: dict) -> int:
    """Seconds of failures a probe tolerates before it acts."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_startup_probe_waits_for_the_model_to_load(container):
    assert budget(container["startupProbe"]) >= MIN_STARTUP_S


def test_termination_grace_outlasts_the_drain(deployment, container, serve_args):
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace >= pre_stop + serve_args.drain_timeout + SERVER_STOP_S
    # a draining server reports NOT_SERVING: liveness must not restart it before the drain ends
    assert budget(container["livenessProbe"]) > serve_args.drain_timeout


def test_services_select_the_pods_and_name_their_ports(deployment, container):
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    assert services["kvserve-headless"]["spec"]["clusterIP"] == "None"  # DNS lists every pod
    assert services["kvserve"]["spec"].get("clusterIP") != "None"
    for svc in services.values():
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports(container)
            assert port["port"] == ports(container)[port["targetPort"]]
    headless_ports = services["kvserve-headless"]["spec"]["ports"]
    assert [p["name"] for p in headless_ports] == ["grpc"] and headless_ports[0]["appProtocol"] == "grpc"


def test_service_monitor_scrapes_the_metrics_port():
    (monitor,) = of_kind("ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in of_kind("Service") if selector.items() <= s["metadata"]["labels"].items()
               and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert len(scraped) == 1
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_pod_runs_as_the_images_user(deployment):
    uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1)
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)
