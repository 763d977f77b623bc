"""Which part of kvserve may import which (docs/design/layout.md states the same rules in words).

Between the top-level packages: the engine knows nothing of the network, the service nothing of
the clients, the clients nothing of the server; only the command line (``cli.py``), the
benchmarks and the test harness (``testing/``) gather them. Inside the engine: the front-end (and
so the gRPC process) never reaches the model's code, layers and models never reach the engine
core, the front-end or the executor, ``distributed/`` and ``process/`` are leaves, the core imports
no model code but the sampler, speculation (``spec_decode/``) reaches none at all, and the control
plane imports no torch. No module imports itself back through others (no circles), no Python file
is over 400 lines (no C source over 600) and no folder but ``models/`` and ``layers/`` holds more
than eight modules. An engine on the CPU never imports Triton (kvserve.kernels loads its Triton
modules on first use).

Imports are read from the source (``ast``), lazy ones inside functions included, so a rule
cannot be dodged by moving an import into a function.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every kvserve module name -> its file, from pyproject.toml's package-dir mapping."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


MODULES = module_files()


def imported_modules(path: Path, known: dict[str, Path] = MODULES) -> set[str]:
    """The kvserve modules a file imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        found |= {n for n in names if n == "kvserve" or n.startswith("kvserve.")}
    return found


GRAPH = {name: imported_modules(path) for name, path in MODULES.items()}


def reachable(start: str, graph: dict[str, set[str]] = GRAPH) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of two or more modules, or a self-import."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def engine(*groups: str) -> tuple[str, ...]:
    return tuple(f"kvserve.engine.{g}" for g in groups)


# ---- top-level packages: subpackage -> the kvserve subpackages its modules must not import
FORBIDDEN = {
    "engine": {"service", "clients", "benchmarks", "testing", "cli"},
    "kernels": {"engine", "service", "clients", "benchmarks", "testing", "cli"},
    "service": {"clients", "benchmarks", "testing", "cli"},
    "clients": {"engine", "kernels", "service", "benchmarks", "testing", "cli"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_layer(package):
    modules = [m for m in GRAPH if under(m, f"kvserve.{package}")]
    assert modules, f"no modules under {package}/"
    offenders = {m: sorted({i.split(".")[1] for i in GRAPH[m] if i != "kvserve"} & FORBIDDEN[package])
                 for m in modules}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


# ---- inside the engine. Transitive: what a module reaches through any chain of imports.
NEVER_REACHES = {
    # the gRPC process never loads the model: the front-end and the service stop short of its code
    "kvserve.engine.frontend": engine("runner", "executor", "layers", "models", "model_loader.loader"),
    "kvserve.service": engine("runner", "executor", "layers", "models", "model_loader.loader"),
    # the building blocks know nothing of who drives them
    "kvserve.engine.layers": engine("core", "frontend", "executor", "runner"),
    "kvserve.engine.models": engine("core", "frontend", "executor", "runner"),
    # leaves: what layers see of TP, and process plumbing
    "kvserve.engine.distributed": engine("core", "frontend", "executor", "runner", "layers", "models"),
    "kvserve.engine.process": engine("core", "frontend", "executor", "runner", "layers", "models"),
    "kvserve.kernels": ("kvserve.engine",),
    # speculation is control-plane logic: what it needs of the model the executor answers
    "kvserve.engine.spec_decode": (*engine("core", "executor", "runner", "layers", "models"),
                                   "kvserve.kernels"),
}


@pytest.mark.parametrize("group", sorted(NEVER_REACHES))
def test_group_never_reaches_what_it_must_not_know(group):
    modules = [m for m in GRAPH if under(m, group)]
    assert modules, f"no modules under {group}"
    offenders = {m: sorted(r for r in reachable(m) if under(r, *NEVER_REACHES[group])) for m in modules}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_models_never_import_a_concrete_attention_backend():
    """A model asks its attention layer through the backend interface (``layers/attention/backend``);
    which backend runs is the runner's choice, one file per backend."""
    concrete = [m for m in GRAPH if under(m, "kvserve.engine.layers.attention") and m.endswith("_backend")]
    assert concrete
    offenders = {m: sorted(i for i in GRAPH[m] if i in concrete)
                 for m in GRAPH if under(m, "kvserve.engine.models")}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_the_core_imports_no_model_code_but_the_sampler():
    """The core drives the executor and asks it (rows alike, block counts); it never looks at the
    model's layers, models or kernels itself. The sampler, which turns its logits into tokens, is
    its one import from layers/."""
    model_code, sampler = (*engine("layers", "models"), "kvserve.kernels"), "kvserve.engine.layers.sampler"
    offenders = {m: sorted(i for i in GRAPH[m] if under(i, *model_code) and i != sampler)
                 for m in GRAPH if under(m, "kvserve.engine.core")}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


# what the service may import of the engine: the front-end, and the vocabulary both sides speak
SERVICE_SEES = (*engine("frontend", "config", "sampling_params", "outputs", "sequence", "process"),)


def test_the_service_reaches_the_engine_only_through_the_front_end():
    """Model facts (sampling defaults, the model's directory) come with the core's ``Ready`` and the
    matched stop string with the output, so service/ needs nothing from model_loader/ or tokenizer/."""
    offenders = {m: sorted(i for i in GRAPH[m] if under(i, "kvserve.engine") and i != "kvserve.engine"
                           and not under(i, *SERVICE_SEES))
                 for m in GRAPH if under(m, "kvserve.service")}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


@pytest.mark.parametrize("group", ["kvserve.engine.distributed", "kvserve.engine.process"])
def test_leaves_import_only_the_engine_config(group):
    imports = {i for m in GRAPH if under(m, group) for i in GRAPH[m]}
    assert {i for i in imports if not under(i, group)} <= {"kvserve", "kvserve.engine.config"}


def test_no_import_circles():
    assert cycles(GRAPH) == []


def engine_group(module: str) -> str:
    """``kvserve.engine.core.scheduler`` -> ``core``; the vocabulary at the engine's top -> ``""``;
    ``llm`` (the offline ``LLM``, which drives the core) is a group of its own, above the rest."""
    parts = module.split(".")
    package = MODULES[module].name == "__init__.py" if module in MODULES else False
    return parts[2] if len(parts) > 3 or package or parts[2:] == ["llm"] else ""


def test_no_two_engine_groups_import_each_other():
    """The shared vocabulary sits at the engine's top so that the groups form layers, not rings."""
    groups: dict[str, set[str]] = {}
    for m, imports in GRAPH.items():
        if under(m, "kvserve.engine") and m != "kvserve.engine":  # __init__ re-exports LLM lazily
            groups.setdefault(engine_group(m), set()).update(
                engine_group(i) for i in imports if under(i, "kvserve.engine") and i != "kvserve.engine")
    assert cycles({g: deps - {g} for g, deps in groups.items()}) == []


def test_the_control_plane_imports_no_torch():
    """The scheduler, block manager and sequence run (and are tested) without torch."""
    code = ("import sys\nimport kvserve.engine.core.scheduler, kvserve.engine.core.block_manager, "
            "kvserve.engine.sequence\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_the_checker_sees_lazy_imports_and_circles(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvserve.clients.client import Client\n"
                      "    import kvserve.service.cli\n    from kvserve.engine import llm\n")
    known = {"kvserve.engine.llm": module}
    assert imported_modules(module, known) == {"kvserve.clients.client", "kvserve.service.cli",
                                               "kvserve.engine.llm"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert reachable("d", {"a": {"b"}, "b": {"c"}, "d": {"a"}}) == {"a", "b", "c"}


# ---- sizes
def tracked_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): every file on disk
        return [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "node_modules" not in p.parts]
    return [ROOT / line for line in listed.stdout.split()]


def test_no_python_file_over_400_lines():
    # protoc's stubs are generated, never read or edited (ruff skips them too); vLLM's ten RPCs
    # make proto/kvserve/vllm/vllm_engine_pb2_grpc.py longer than that
    long = {str(p.relative_to(ROOT)): n for p in tracked_python_files()
            if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_no_c_source_over_600_lines():
    """The CPU kernels: a source that holds several instruction sets under #if splits them into a
    file each (gemm_avx512.h / gemm_avx2.h, attention_avx512.h / attention_avx2.h) before this."""
    csrc = ROOT / "kernels" / "cpu" / "csrc"
    long = {p.name: n for p in sorted(csrc.glob("*.[ch]")) if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


# models/ and layers/ grow one file per architecture or building block, like the anchors' own
ANY_SIZE = {"engine/models", "engine/layers"}


def test_no_folder_holds_more_than_eight_modules():
    per_folder = Counter(str(p.parent.relative_to(ROOT)) for p in tracked_python_files())
    crowded = {folder: n for folder, n in per_folder.items() if n > 8 and folder not in ANY_SIZE}
    assert crowded == {}


CPU_ENGINE = """
import sys
from kvserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=32, max_model_len=128)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
assert len(out[0].token_ids) == 4
print("TRITON IMPORTED", "triton" in sys.modules)
"""


def test_an_engine_on_the_cpu_never_imports_triton(tmp_path):
    """Importing Triton costs ~0.3 s at start, and its bindings print "leaked instances" at exit."""
    import torch

    from kvserve.testing.random_model import write_random_model

    model = write_random_model("qwen3-tiny", tmp_path, dtype=torch.float32)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CPU_ENGINE, str(model)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRITON IMPORTED False" in done.stdout
