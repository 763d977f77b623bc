"""Log output of the server and its engine core: ``--log-format text`` (one readable line per
record) or ``json`` (one JSON object per line, for a log pipeline).

A record may carry structured fields (``log.info(msg, extra={"fields": {...}})``): the text
format appends them as ``key=value``, the JSON format puts them in the object as they are.
Records logged inside a traced call carry its ``trace_id`` and ``span_id`` in both formats, so
a log line leads to its trace. The engine-core process is a child of the server and inherits
the format through ``KVSERVE_LOG_FORMAT``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "KVSERVE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(component)s: %(message)s"


def configure_logging(level: str, fmt: str = "text", component: str = "") -> None:
    """Send every record to stderr in ``fmt`` (text or json); ``component`` tags the process
    (e.g. "core"). Also exports the format so that child processes log the same way."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format: must be one of {list(LOG_FORMATS)}, got {fmt!r}")
    os.environ[LOG_FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component) if fmt == "json" else TextFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def inherited_log_format() -> str:
    """The format the parent process chose (text when none)."""
    return os.environ.get(LOG_FORMAT_ENV, "text")


def trace_ids() -> dict[str, str]:
    """The current span's trace and span ids as hex, or {} outside a traced call."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def record_fields(record: logging.LogRecord) -> dict:
    fields = dict(getattr(record, "fields", None) or {})
    for key, value in trace_ids().items():
        fields.setdefault(key, value)
    return fields


class TextFormatter(logging.Formatter):
    def __init__(self, component: str = ""):
        super().__init__(TEXT_FORMAT)
        self._component = f"[{component}]" if component else ""

    def format(self, record: logging.LogRecord) -> str:
        record.component = self._component
        line = super().format(record)
        fields = record_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    converter = time.gmtime  # timestamps in UTC, as the Z says

    def __init__(self, component: str = ""):
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._component:
            obj["component"] = self._component
        obj.update(record_fields(record))
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)



def _text_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, str) and (not value or any(c.isspace() or c in "\"=" for c in value)):
        return json.dumps(value)  # quoted, so a client's string cannot fake another field
    return str(value)
