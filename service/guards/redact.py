"""Client-given strings made safe to log or to send back in a status message.

A request id, a chat role or a stop string is whatever the client sent: a 15 MiB request id
logged whole wrote 150 MiB of log in under a second, and a newline in it forged log lines.
Everything client-given goes through ``for_log`` before it reaches a log line (cut to a
short prefix, control and non-ASCII characters escaped), and every status message through
``clip`` (gRPC sends it in a trailer; one over the peer's metadata limit turns the answer into
a different error).
"""

from __future__ import annotations

LOG_CHARS = 64  # of a client-given string in one log line
STATUS_MESSAGE_CHARS = 1024  # of a status message (a trailer; peers accept 8 KiB of metadata)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was when it was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} chars)"


def for_log(value: object, limit: int = LOG_CHARS) -> str:
    """One printable ASCII token for a log line: cut to ``limit`` characters, then escaped
    (a newline becomes ``\\n``, so it cannot start a forged line)."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    escaped = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in escaped)
    return f"{escaped}...({len(text)} chars)" if cut else escaped


def quoted(value: str, limit: int = LOG_CHARS) -> str:
    """``for_log`` in quotes, for a client-given value inside a status message."""
    return f"'{for_log(value, limit)}'"
