"""What the server reports to the outside: per-call telemetry (``calls``), Prometheus metrics
(``metrics``), OpenTelemetry tracing (``tracing``) and the start and stop of them all
(``observability``).
"""
