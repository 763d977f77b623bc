"""kvserve.benchmarks."""

from __future__ import annotations

import json


def write_json(path: str | None, figures: dict) -> None:
    """Every benchmark's ``--json FILE``: the figures it printed, indented; nothing when ``path`` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)
