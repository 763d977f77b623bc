"""Which part of kvserve may import which: the engine knows nothing of the network, the
service nothing of the clients, the clients nothing of the server. Only the command line
(``cli.py``), the benchmarks and the test harness (``testing/``) gather them."""

from __future__ import annotations

import ast
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
