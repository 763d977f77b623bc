"""What the service sees of the engine: its lifecycle state, the facts about the loaded model,
and the two errors a request can meet before it runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.config import EngineConfig


class EngineOverloaded(Exception):
    """The admission queue is full; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine is loading, draining, stopped or dead."""


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # finishing what it has, admitting nothing new
    DEAD = "dead"  # the engine failed; nothing will run again
    STOPPED = "stopped"


@dataclass
class EngineInfo:
    """Immutable facts about the loaded engine."""

    model_name: str
    vocab_size: int
    config: EngineConfig  # as resolved by the core (max_model_len filled in)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len
