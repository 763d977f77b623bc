"""What the runner tests over decode graphs share: a recorder that stands in for CUDA graph
capture (a replay re-runs the captured body on the same static buffers, which is what a CUDA
graph does, and counts the replays), and the tiny Triton runner configuration they build."""

from __future__ import annotations

from kvserve.engine.config import EngineConfig
from kvserve.engine.model_input import ModelInput

BLOCK = 16
MAX_NUM_SEQS = 4  # captured sizes 1, 2, 4


class FakeGraph:
    def __init__(self, body):
        self.body, self.replays = body, 0

    def replay(self):
        self.replays += 1
        self.body()

    def pool(self):
        return None


class Recorder:
    """Stands in for CUDA graph capture; records nothing on the device."""

    def __init__(self):
        self.graphs = []

    def __call__(self, body, pool):
        self.graphs.append(FakeGraph(body))
        return self.graphs[-1]


def triton_runner_config(model_dir, num_kv_blocks: int, **changes) -> EngineConfig:
    """A float32 runner of the tiny model on the Triton backend, graphs up to MAX_NUM_SEQS."""
    fields = dict(model=str(model_dir), dtype="float32", attention_backend="triton", block_size=BLOCK,
                  max_num_seqs=MAX_NUM_SEQS, max_model_len=64, num_kv_blocks=num_kv_blocks)  # fmt: skip
    return EngineConfig(**{**fields, **changes})


class Seq:
    """A sequence of a runner-level test: its own blocks (4 per sequence, from block 1 on), its
    prompt, its tokens so far, and (a hybrid's) its state slot."""

    def __init__(self, index: int, prompt_len: int, slot: int | None = None):
        self.blocks = list(range(1 + 4 * index, 5 + 4 * index))
        self.slot = slot
        self.prompt = [(7 * index + 3 * j) % 10240 for j in range(prompt_len)]
        self.len = 0


def step(seqs: list[Seq], new_ids: list[list[int]], logits_for: list[bool] | None = None) -> ModelInput:
    """One step in which ``seqs[i]`` computes ``new_ids[i]``; logits for the rows ``logits_for`` marks
    (all by default); each sequence's state slot where it has one."""
    inp = ModelInput()
    for i, (seq, ids) in enumerate(zip(seqs, new_ids, strict=True)):
        positions = range(seq.len, seq.len + len(ids))
        seq.len += len(ids)
        inp.input_ids += ids
        inp.positions += positions
        inp.slot_mapping += [seq.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
        inp.query_lens.append(len(ids))
        inp.context_lens.append(seq.len)
        inp.block_tables.append(seq.blocks[: -(-seq.len // BLOCK)])
        if seq.slot is not None:
            inp.state_slots.append(seq.slot)
        if logits_for is None or logits_for[i]:
            inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp
