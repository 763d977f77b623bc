"""The ``kvserve.v1.LLMService`` handlers (``servicer``) and the conversions around them: gRPC
request -> engine request (``validation``), engine outputs -> gRPC messages (``responses``) and
which status an error becomes (``errors``).
"""
