"""The front-end half of the core link, in the gRPC server's process: ``AsyncEngine`` (what the
servicer calls), the ``CoreClient`` that starts the engine-core process and talks to it over
ZeroMQ, per-request streams and the engine's state. It never loads the model: it imports no
runner, executor, layers or models (tests/test_layering.py holds that).
"""
