"""Log formats: JSON lines carry the record's fields and the current trace; text lines append
the fields as key=value, quoting values a client could use to fake another field."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvserve.logs import JsonFormatter, TextFormatter, configure_logging, inherited_log_format


def record(msg: str, fields: dict | None = None, exc_info=None) -> logging.LogRecord:
    rec = logging.LogRecord("kvserve.service", logging.INFO, __file__, 1, msg, (), exc_info)
    if fields is not None:
        rec.fields = fields
    return rec


def test_json_line_has_the_fields_and_the_current_trace():
    ctx = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(ctx)):
        rec = record("request r1 finished", {"request_id": "r1", "ttft_ms": 1.5})
        line = JsonFormatter("core").format(rec)
    obj = json.loads(line)
    assert obj["message"] == "request r1 finished" and obj["level"] == "info" and obj["component"] == "core"
    assert obj["request_id"] == "r1" and obj["ttft_ms"] == 1.5
    assert obj["trace_id"] == f"{0x1234:032x}" and obj["span_id"] == f"{0x99:016x}"
    assert obj["time"].endswith("Z")


def test_json_line_carries_the_exception():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        line = JsonFormatter().format(record("failed", exc_info=sys.exc_info()))
    obj = json.loads(line)
    assert "RuntimeError: boom" in obj["exception"] and "trace_id" not in obj  # no span: no trace id


def test_text_line_appends_fields_and_quotes_client_strings():
    line = TextFormatter().format(record("request x finished", {"request_id": "a b status=OK", "n": 3,
                                                                "ttft_ms": 12.345}))
    assert line.endswith('request x finished request_id="a b status=OK" n=3 ttft_ms=12.3')


def test_configure_logging_picks_the_format_and_children_inherit_it(monkeypatch):
    monkeypatch.delenv("KVSERVE_LOG_FORMAT", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("warning", "json")
        assert isinstance(root.handlers[0].formatter, JsonFormatter) and root.level == logging.WARNING
        assert inherited_log_format() == "json"
        with pytest.raises(ValueError, match="log format"):
            configure_logging("info", "yaml")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
