"""Harness for tests and benchmarks: a ``kvserve serve`` child process on a free port
(``process``), the pytest plugin with the shared test servers (``plugin``) and throwaway TLS
certificates (``tls``). It sits above the service and the clients and imports both; neither
of them imports it.
"""
