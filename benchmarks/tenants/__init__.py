"""Tenants sharing one server (issue 49): ``python -m kvserve.benchmarks.tenants`` (see __main__)."""
