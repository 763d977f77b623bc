"""What the runner tests over decode graphs share: a recorder that stands in for CUDA graph
capture (a replay re-runs the captured body on the same static buffers, which is what a CUDA
graph does, and counts the replays), and the tiny Triton runner configuration they build."""

from __future__ import annotations

from kvserve.engine.config import EngineConfig

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
