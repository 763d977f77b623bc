"""What the service sees of the engine: its lifecycle state, the facts about the loaded model,
and the errors a request can meet before it runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.ipc import EngineStats, ModelFacts


class EngineOverloaded(Exception):
    """The admission queue is full; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine is loading, draining, stopped or dead."""


class DeadlineUnmet(Exception):
    """The request cannot start or finish before its deadline (the core's step time model says so)."""


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # finishing what it has, admitting nothing new
    DEAD = "dead"  # the engine failed; nothing will run again
    STOPPED = "stopped"


@dataclass(frozen=True)
class EngineInfo:
    """Immutable facts about the loaded engine: the core's (``Ready``) and the front-end's."""

    facts: ModelFacts
    config: EngineConfig  # as resolved by the core (max_model_len filled in)
    has_chat_template: bool  # the front-end's tokenizer has one (``messages`` prompts need it)

    @property
    def model_name(self) -> str:
        return self.facts.model

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's recommended sampling, for a request's unset fields."""
        return self.facts.sampling_defaults


class ServerStats(EngineStats, kw_only=True, tag="server_stats"):
    """The engine core's stats plus the front-end's admission fields (Stats, /metrics)."""

    num_queued: int  # admitted, not yet handed to the scheduler (tokenizing, or in flight to the core)
    max_queue: int  # --max-queue: the most requests admitted but not yet running
    requests_rejected: int  # refused because the admission queue was full


def served_model_name(model: str) -> str:
    """The name the engine will report for ``--model`` (known before it loads: metrics labels)."""
    from kvserve.engine.model_loader.source import resolve_model  # torch and transformers: only when needed

    try:
        return resolve_model(model).name
    except ValueError:  # the engine reports the error when it tries to load it
        return model
