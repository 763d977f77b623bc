"""A request inside the engine: its tokens, its place in the KV cache and its progress.

Plain Python (no torch): the scheduler and block manager work on these objects.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the names match the gRPC ``FinishReason`` enum."""

    STOP = "stop"  # EOS or a stop token id
    STOP_STRING = "stop_string"
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"

    def replaces(self, earlier: FinishReason | None) -> bool:
        """Whether this reason, found for a sequence that ``earlier`` already ended in the same
        step, is the one to report: a stop string completed by the last allowed token is what
        ended the text (its tail is cut), so STOP_STRING wins over LENGTH."""
        return earlier is None or (self is FinishReason.STOP_STRING and earlier is FinishReason.LENGTH)


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whose request this is and how urgent (engine/tenancy/shares.py): the caller's tenant (an opaque,
    hashed id; "" = the one tenant of a server without tenants), its ``priority`` (lower = earlier,
    as vLLM's) and its ``deadline`` (``time.monotonic()`` seconds; None = none)."""

    tenant: str = ""
    priority: int = 0
    deadline: float | None = None


PLAIN = Tenancy()


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tenancy: Tenancy = PLAIN):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.params = params
        self.tenancy = tenancy
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # tokens whose KV is in the cache (prefix-cache hits included)
        self.num_computed_tokens = 0
        # tokens of the prompt found in the prefix cache at the first admission (for usage)
        self.num_cached_prompt_tokens: int | None = None
        # one block table per KV cache group (engine/kv_cache/groups.py), all as long; the block
        # manager sizes the list; ``block_table`` is the first group's
        self.block_tables: list[list[int]] = [[]]
        self.state_slot: int | None = None  # its row of the state cache (models with a recurrent state)
        # with a recurrent state: its prefill stops here once, where its state is kept (a snapshot
        # for prefix hits, copies for its other choices): the end of the prompt's last full block
        self.checkpoint_at: int | None = None
        # and earlier stops whose states are kept as snapshots only: chat-turn boundaries
        # (kv_cache/state_slots.py ``turn_checkpoints``), ascending, each before ``checkpoint_at``
        self.turn_checkpoints: tuple[int, ...] = ()
        self.num_hashed_blocks = 0  # leading columns of the tables whose hashes are published
        self.block_hashes: list[int] = []  # the hash chain of the full blocks computed so far
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.times = SequenceTimes()
        self.num_preemptions = 0
        # speculative decoding (engine/spec_decode/): the drafts proposed for the next step, and the
        # sequence's drafter state (None until it first drafts)
        self.draft_token_ids: list[int] = []
        self.spec = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_decoding(self) -> bool:
        """One token left to compute: the sequence's next row is a decode row."""
        return len(self.token_ids) - self.num_computed_tokens == 1

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
