"""Server reflection that carries the .proto comments, so that ``grpcurl describe`` shows the
API's documentation with no .proto file at hand.

grpcio-reflection serves descriptors from the generated stubs, which hold no comments. Here
the files of our API are compiled once more at start-up with their source info (the comments)
and those descriptors replace the bare ones in every reflection answer.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvserve.service import protogen

log = logging.getLogger("kvserve.service")


class DocumentedReflectionServicer(reflection.aio.ReflectionServicer):
    def __init__(self, service_names, documented: dict[str, bytes]):
        super().__init__(service_names)
        self._documented = documented  # file name -> serialized FileDescriptorProto with comments

    def _file_by_filename(self, request, filename):
        return self._with_comments(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request, fully_qualified_name):
        return self._with_comments(super()._file_containing_symbol(request, fully_qualified_name))

    def _with_comments(self, resp: reflection_pb2.ServerReflectionResponse):
        if resp.HasField("file_descriptor_response"):
            protos = resp.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(protos):
                name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                if name in self._documented:
                    protos[i] = self._documented[name]
        return resp


def documented_descriptors() -> dict[str, bytes]:
    """Our .proto files compiled with their comments; empty if that fails (reflection still works)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "api.pb"
            protogen.protoc(["--include_source_info", f"--descriptor_set_out={path}",
                             *protogen.proto_names()])
            files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file
    except Exception as e:  # noqa: BLE001 - comments are a nicety, never a reason not to start
        log.warning("reflection will carry no comments: %s", e)
        return {}
    return {f.name: f.SerializeToString() for f in files}


def enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = DocumentedReflectionServicer(names, documented_descriptors())
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
