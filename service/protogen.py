"""Regenerates the Python stubs of ``proto/kvserve/v1/*.proto`` (kvserve's API) and
``proto/kvserve/vllm/*.proto`` (vLLM's engine protocol, for the mesh gateways) (``make proto``).

The stubs are committed beside the .proto files so that the package installs without a
build step; ``tests/service/test_proto_stubs.py`` fails when they no longer match the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kvserve.v1

# proto/kvserve/v1 in the source tree, site-packages/kvserve/v1 in an installed wheel
PROTO_DIR = Path(kvserve.v1.__file__).resolve().parent
PROTO_ROOT = PROTO_DIR.parents[1]
# the packages whose stubs are generated: kvserve's API and vLLM's engine protocol
PROTO_PACKAGES = ("v1", "vllm")


def proto_files() -> list[Path]:
    """The .proto files of every package, sorted."""
    return sorted(p for pkg in PROTO_PACKAGES for p in (PROTO_ROOT / "kvserve" / pkg).glob("*.proto"))


def proto_names() -> list[str]:
    """The same files as protoc names them (``kvserve/v1/llm.proto``)."""
    return [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]


def protoc(args: list[str]) -> None:
    """Run grpcio-tools' protoc with the API's include path and the well-known types."""
    import grpc_tools
    from grpc_tools import protoc as _protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    argv = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *args]
    if _protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(argv)}")


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every .proto under ``out_dir``."""
    outs = [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    protoc([*outs, *proto_names()])
    return sorted(p for pkg in PROTO_PACKAGES for p in (out_dir / "kvserve" / pkg).glob("*_pb2*.py*"))


def descriptor_set(path: Path) -> bytes:
    """The serialized FileDescriptorSet protoc builds from the current .proto files."""
    protoc([f"--descriptor_set_out={path}", *proto_names()])
    return path.read_bytes()


def main() -> int:
    for path in generate():
        print(path.relative_to(PROTO_ROOT.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
