"""Decode CUDA-graph logic on the CPU: the captured sizes, bucket choice, padding, and the
runner's capture/replay bookkeeping with a recorder that replays by re-running the captured
body (what a CUDA graph does on the same static buffers)."""

from dataclasses import dataclass

import pytest
import torch

from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    PAD_VALUES,
    CudaGraphRunner,
    DecodeInputs,
    allocate_static_inputs,
    block_table_width,
    bucket_for,
    capture_sizes,
    copy_padded,
    decode_inputs,
)


def test_capture_sizes_follow_the_ladder_and_always_cover_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]  # not a multiple of 16: one size past it
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    assert len(capture_sizes(512)) == 4 + 32


@pytest.mark.parametrize("max_num_seqs", [1, 5, 17, 20, 100, 512])
def test_every_allowed_batch_size_has_a_bucket_that_holds_it(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    for batch in range(1, max_num_seqs + 1):
        bucket = bucket_for(batch, sizes)
        assert bucket is not None and bucket >= batch
        assert all(s < batch for s in sizes if s < bucket)  # the smallest that holds it


def test_bucket_is_none_above_the_largest_captured_size():
    sizes = capture_sizes(600)
    assert bucket_for(512, sizes) == 512
    assert bucket_for(513, sizes) is None


def test_capture_sizes_rejects_zero_sequences():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_block_tables_are_as_wide_as_max_model_len_needs():
    assert block_table_width(4096, 16) == 256
    assert block_table_width(100, 16) == 7
    assert allocate_static_inputs(4, block_table_width(100, 16), "cpu").block_tables.shape == (4, 7)


def decode_batch(token_ids, block_tables, block_size=4):
    """A decode batch for sequences whose lengths follow from their last tokens' positions."""
    lengths = [len(t) * block_size - 1 for t in block_tables]  # last block one short of full
    return DecodeInputs(
        input_ids=torch.tensor(token_ids),
        positions=torch.tensor([n - 1 for n in lengths]),
        slot_mapping=torch.tensor(
            [t[-1] * block_size + (n - 1) % block_size for t, n in zip(block_tables, lengths, strict=True)]
        ),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
    )


def test_copy_padded_fills_real_rows_and_pads_the_rest_of_the_bucket():
    static = allocate_static_inputs(8, 5, "cpu")
    static.block_tables.fill_(99)  # stale entries from an earlier, wider batch
    inputs = decode_batch([11, 12, 13], [[3, 4], [5, 6], [7, 1]])

    padded = copy_padded(static, inputs, bucket=4)

    assert padded.batch_size == 4
    assert padded.input_ids.data_ptr() == static.input_ids.data_ptr()  # views, not copies
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(padded, name)[:3], getattr(inputs, name).to(getattr(padded, name).dtype))
        assert getattr(padded, name)[3].item() == PAD_VALUES[name]
    assert torch.equal(padded.block_tables[:3, :2], inputs.block_tables)
    assert bool((padded.block_tables[:3, 2:] == 0).all()) and bool((padded.block_tables[3] == 0).all())


def test_copy_padded_rejects_a_block_table_wider_than_captured():
    static = allocate_static_inputs(4, 2, "cpu")
    with pytest.raises(ValueError, match="outgrew max_model_len"):
        copy_padded(static, decode_batch([1], [[1, 2, 3]]), bucket=1)


def test_runner_refuses_a_cpu_device_with_real_cuda_graphs():
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(lambda *a: None, lambda i: i, 4, 64, 4, "cpu")


def model_input(query_lens, block_tables, block_size=4):
    """A step of sequences whose last block is one short of full, computing ``query_lens`` tokens."""
    inp = ModelInput()
    for q, table in zip(query_lens, block_tables, strict=True):
        length = len(table) * block_size - 1
        positions = range(length - q, length)
        inp.input_ids += [100 + p for p in positions]
        inp.positions += positions
        inp.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in positions]
        inp.query_lens.append(q)
        inp.context_lens.append(length)
        inp.block_tables.append(table)
        inp.logits_indices.append(len(inp.input_ids) - 1)
    return inp


def test_decode_inputs_are_the_step_rows_with_block_tables_padded_with_zero():
    inp = model_input([1, 1], [[3, 4], [9]])
    rows = decode_inputs(inp, pin=False)
    assert rows.input_ids.tolist() == [106, 102] and rows.positions.tolist() == [6, 2]
    assert rows.slot_mapping.tolist() == [18, 38] and rows.seq_lens.tolist() == [7, 3]
    assert rows.block_tables.tolist() == [[3, 4], [9, 0]]
    assert (rows.seq_lens.dtype, rows.block_tables.dtype, rows.slot_mapping.dtype) == (
        torch.int32, torch.int32, torch.int64)
    assert not rows.input_ids.is_pinned()


def test_runner_fits_only_decode_steps_of_a_captured_size_within_the_captured_width():
    runner = CudaGraphRunner(TinyModel(8).forward, build_metadata, 4, 8, 4, "cpu", record=ReplayingRecorder())
    runner.capture()  # sizes 1, 2, 4; block tables 2 wide
    assert runner.fits(model_input([1, 1, 1], [[1], [2, 3], [4]]))
    assert not runner.fits(model_input([1] * 5, [[1]] * 5))  # above the largest size
    assert not runner.fits(model_input([1, 2], [[1], [2, 3]]))  # a two-token chunk: not decode-only
    assert not runner.fits(model_input([1], [[1, 2, 3]]))  # outgrew the captured width: runs eagerly
    assert not runner.fits(model_input([], []))


# ---------------------------------------------------------------- runner with a fake recorder


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


class ReplayingRecorder:
    """Stands in for torch.cuda.graph: replay re-runs the captured body on the same buffers."""

    def __init__(self):
        self.calls = []  # (pool passed in, graph)

    def __call__(self, body, pool):
        graph = FakeGraph(body)
        self.calls.append((pool, graph))
        return graph


class FakeGraph:
    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()

    def pool(self):
        return ("pool", id(self))


class TinyModel:
    """Uses every decode input: writes its token into a cache at the slot, reads its blocks."""

    def __init__(self, num_slots):
        self.cache = torch.zeros(num_slots)

    def forward(self, input_ids, positions, meta):
        written = meta.slot_mapping >= 0
        self.cache[meta.slot_mapping[written]] = input_ids[written].float()
        blocks = meta.block_tables.long().float().sum(1)
        return torch.stack([input_ids.float(), positions.float(), meta.seq_lens.float(), blocks], dim=1)


def build_metadata(inputs):
    return Metadata(inputs.slot_mapping, inputs.seq_lens, inputs.block_tables)


def test_runner_captures_largest_first_in_one_shared_pool_and_replays_the_batch_it_is_given():
    graphed, eager = TinyModel(64), TinyModel(64)
    recorder = ReplayingRecorder()
    runner = CudaGraphRunner(graphed.forward, build_metadata, 20, 16, 4, "cpu", record=recorder)
    runner.capture()
    assert not graphed.cache.any()  # warm-up and capture ran on padding rows only: nothing written

    assert [g for _, g in recorder.calls] == [runner.graphs[s] for s in (32, 16, 8, 4, 2, 1)]
    first_pool = recorder.calls[0][1].pool()
    assert [p for p, _ in recorder.calls] == [None] + [first_pool] * 5

    for tokens, tables in (([5, 6, 7], [[1, 2], [3, 4], [5, 6]]), ([9], [[7, 8, 9, 10]])):
        inputs = decode_batch(tokens, tables)
        hidden = runner.replay(inputs)
        expected = eager.forward(inputs.input_ids, inputs.positions, build_metadata(inputs))
        assert torch.equal(hidden, expected)
        assert torch.equal(graphed.cache, eager.cache)  # padded rows wrote no K/V


def test_runner_has_no_graph_for_a_batch_above_the_largest_size():
    runner = CudaGraphRunner(TinyModel(8).forward, build_metadata, 2, 8, 4, "cpu", record=ReplayingRecorder())
    runner.capture()
    assert runner.can_replay(2) and not runner.can_replay(3)
    with pytest.raises(ValueError, match="run it eagerly"):
        runner.replay(decode_batch([1, 2, 3], [[0], [1], [0]]))
    runner.close()
    assert not runner.can_replay(1)


def test_capture_of_some_sizes_then_others_shares_the_first_pool():
    recorder = ReplayingRecorder()
    runner = CudaGraphRunner(TinyModel(8).forward, build_metadata, 20, 16, 4, "cpu", record=recorder)
    runner.capture([32])  # what the memory measurement does first: the largest alone
    runner.capture([1])
    assert runner.captured == [1, 32] and [p for p, _ in recorder.calls] == [None, runner.pool]
    with pytest.raises(ValueError, match=r"sizes \[3\] are not among"):
        runner.capture([3])
    runner.close()
    assert runner.pool is None and runner.captured == []
