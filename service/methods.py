"""gRPC method names (``/package.Service/Method``): the one parser of them, and the services
and methods the server treats apart, named from the generated descriptors (a renamed or
misspelled method fails at import, not silently at run time)."""

from __future__ import annotations

from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvserve.v1 import llm_pb2
from kvserve.vllm import vllm_engine_pb2

LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"]
VLLM_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


def split_method(method: str) -> tuple[str, str]:
    """``/grpc.health.v1.Health/Check`` -> (``grpc.health.v1.Health``, ``Check``)."""
    service, _, name = method.lstrip("/").partition("/")
    return service, name


def method_path(service: ServiceDescriptor, name: str) -> str:
    """What gRPC calls ``service``'s method ``name`` by: ``/kvserve.v1.LLMService/WatchStats``."""
    return f"/{service.full_name}/{service.methods_by_name[name].name}"
