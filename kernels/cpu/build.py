"""Building the CPU kernels (``csrc/*.c``) and caching the shared object (bindings.py loads it).

Build: ``$CC`` or ``cc`` with ``-O3 -march=native -fopenmp`` and the flags below, each source on
its own process (as many at once as there are CPUs), then linked; the shared object is cached
under ``$KVSERVE_CACHE_DIR/kernels`` (default ``~/.cache/kvserve``), named by a hash of the
sources, the flags, the compiler's version and this CPU's feature flags, so a cache shared
between machines never hands one CPU another's instructions. ``$KVSERVE_CPU_MARCH`` replaces
``native`` (``x86-64-v3``: the portable path on any AVX2 CPU, without the AVX-512 kernels).

Which CPU gets which path is decided at build time by the compiler's target macros: AVX-512
(F, BW, VL; VNNI and BF16 where present) takes the vector paths of csrc/; every other CPU
(x86-64 without AVX-512, aarch64) the portable C loops, which the compiler vectorises for its
target. A compiler without OpenMP fails the build, and the engine keeps torch ops.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("csrc")
MARCH_ENV = "KVSERVE_CPU_MARCH"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")


def header_constant(name: str, header: str = "common.h") -> int:
    """A ``#define`` of csrc/common.h (or another header of csrc/): the kernels' shape limits and
    codes are written once, there."""
    match = re.search(rf"^#define {name} (\d+)$", (SOURCE_DIR / header).read_text(), re.MULTILINE)
    return int(match.group(1))


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "kernels"


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else ""


def flags() -> tuple[str, ...]:
    """FLAGS with ``-march=$KVSERVE_CPU_MARCH`` where that is set."""
    march = os.environ.get(MARCH_ENV)
    if not march:
        return FLAGS
    if not re.fullmatch(r"[\w.+-]+", march):
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a -march value")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def artifact(cc: str) -> Path:
    """Where the shared object for these sources, flags, compiler and CPU is cached."""
    parts = [p.read_bytes() for p in sources()]
    parts += [" ".join(flags()).encode(), compiler_version(cc).encode(), cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def build(cc: str) -> Path:
    """The cached shared object for these sources, compiler and CPU (compiled when missing)."""
    target = artifact(cc)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = _compile_each(cc, [p for p in sources() if p.suffix == ".c"], Path(tmp))
        _run(cc, [cc, *LINK_FLAGS, "-o", str(built), *objects, "-lm"])  # libm: tanhf (attention.c's soft cap)
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _compile_each(cc: str, c_files: list[Path], out_dir: Path) -> list[str]:
    """Each source to an object file, on as many processes as there are CPUs, the largest first
    (attention.c alone takes most of the build: ~27 s of ~42 on the development machine)."""
    c_files = sorted(c_files, key=lambda p: p.stat().st_size, reverse=True)
    objects = [str(out_dir / f"{p.stem}.o") for p in c_files]
    compile_flags = [f for f in flags() if f != "-shared"]
    with ThreadPoolExecutor(max_workers=max(1, min(len(c_files), os.cpu_count() or 1))) as pool:
        jobs = [pool.submit(_run, cc, [cc, *compile_flags, "-c", "-o", obj, str(src)])
                for src, obj in zip(c_files, objects, strict=True)]
        for job in jobs:
            job.result()
    return objects


def _run(cc: str, cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        err = result.stderr.strip()
        if "fopenmp" in err or "omp.h" in err or "gomp" in err:
            raise RuntimeError(f"{cc} has no OpenMP (-fopenmp, omp.h, libgomp): {err[-500:]}")
        raise RuntimeError(f"{cc} failed ({result.returncode}): {err[-2000:]}")
