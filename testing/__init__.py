"""Harness for tests and benchmarks: a ``kvserve serve`` child process on a free port
(``process``), the pytest plugin with the shared test servers (``plugin``), throwaway TLS
certificates (``tls``) and an ``LLM`` with another control plane over the same loaded model
(``engine``). It sits above the service, the clients and the engine and imports them; none of
them imports it.
"""
