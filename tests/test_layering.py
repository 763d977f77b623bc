"""Which part of kvserve may import which: the engine knows nothing of the network, the
service nothing of the clients, the clients nothing of the server. Only the command line
(``cli.py``), the benchmarks and the test harness (``testing/``) gather them. And an engine on
the CPU never imports Triton (kvserve.kernels loads its Triton modules on first use)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# subpackage -> the kvserve subpackages its modules must not import
FORBIDDEN = {
    "engine": {"service", "clients", "benchmarks", "testing", "cli"},
    "kernels": {"engine", "service", "clients", "benchmarks", "testing", "cli"},
    "service": {"clients", "benchmarks", "testing", "cli"},
    "clients": {"engine", "kernels", "service", "benchmarks", "testing", "cli"},
}


def kvserve_imports(path: Path) -> set[str]:
    """The kvserve subpackages (first name after ``kvserve.``) a module imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvserve" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_layer(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules under {package}/"
    offenders = {
        str(m.relative_to(ROOT)): sorted(kvserve_imports(m) & FORBIDDEN[package]) for m in modules
    }
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvserve.clients.client import Client\n"
                      "    import kvserve.service.cli\n")
    assert kvserve_imports(module) == {"clients", "service"}


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
