"""kvserve.service: the gRPC server process. ``server`` puts LLMService (``api/``), health and
reflection on one grpc.aio server behind the ``guards/`` and ``telemetry/`` interceptors;
``cli`` is ``kvserve serve``; ``methods`` parses method names; ``protogen`` regenerates the stubs.
"""
