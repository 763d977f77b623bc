"""kvserve.benchmarks: benchmarks that run the peer in the same run and print the ratio. Offline
throughput (``offline``), one stream (``single_stream``), a step's profile (``profile_step``), the
CPU attention kernel (``attention_cpu``), ``serving/`` and what they share: the peers (``peers``),
figures (``plots``), ``instruments/`` and structured output's cost (``structured``)."""

from __future__ import annotations

import json


def write_json(path: str | None, figures: dict) -> None:
    """Every benchmark's ``--json FILE``: the figures it printed, indented; nothing when ``path`` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)
