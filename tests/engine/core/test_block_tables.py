"""The persistent block table: the engine's writer hands out rows and sends only new blocks; a
runner's array, fed only those updates, always holds every running sequence's table. Checked
over a random run with growth, finishes, preemptions and row reuse, and through the JSON that
goes to tensor-parallel workers."""

import random

import numpy as np
import pytest

from kvserve.engine.core.step_time import ScheduledSeq
from kvserve.engine.model_input import BlockTableArray, BlockTableWriter, ModelInput, build_model_input
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence


def test_a_decode_step_that_adds_no_block_sends_nothing_but_rows():
    writer = BlockTableWriter(num_rows=4, width=8)
    assert writer.place(7, [3, 9]) == (0, [0, 0, 3, 9])
    assert writer.place(8, [5]) == (1, [1, 0, 5])
    assert writer.place(7, [3, 9]) == (0, None)  # nothing new
    assert writer.place(7, [3, 9, 4]) == (0, [0, 2, 4])  # only the appended block


def test_rows_of_sequences_that_stopped_running_are_reused_and_rewritten_whole():
    writer, array = BlockTableWriter(2, 8), BlockTableArray(2, 8)
    array.apply([writer.place(1, [3, 9, 4])[1], writer.place(2, [6])[1]])
    writer.retain([2])  # sequence 1 finished (or was preempted)
    row, update = writer.place(3, [8])
    assert row == 0 and update == [0, 0, 8]
    array.apply([update])
    assert array.gather([0, 1], 1).tolist() == [[8], [6]]
    with pytest.raises(RuntimeError, match="more running sequences than block-table rows"):
        writer.place(4, [1])
    with pytest.raises(ValueError, match="exceeds the width 8"):
        writer.place(2, list(range(9)))


def test_an_array_fed_only_updates_matches_the_tables_over_a_random_run():
    rng = random.Random(0)
    writer, array = BlockTableWriter(6, 32), BlockTableArray(6, 32)
    tables: dict[int, list[int]] = {}
    next_id, next_block = 0, 0
    for _ in range(300):
        if len(tables) < 6 and rng.random() < 0.3:  # admit, sometimes with a prefix hit of shared blocks
            tables[next_id] = rng.sample(range(100), rng.randint(0, 3))
            next_id += 1
        for seq_id in list(tables):
            if rng.random() < 0.1:
                del tables[seq_id]  # finished, aborted or preempted (readmitted later under a new id)
            elif rng.random() < 0.4 and len(tables[seq_id]) < 32:
                tables[seq_id].append(next_block)
                next_block += 1
        writer.retain(tables)
        step = [s for s in tables if rng.random() < 0.8]
        placed = [writer.place(s, tables[s]) for s in step]
        array.apply([update for _, update in placed if update is not None])
        rows = [row for row, _ in placed]
        assert len(set(rows)) == len(rows)
        for s, row in zip(step, rows, strict=True):
            assert array.array[row, : len(tables[s])].tolist() == tables[s]


def test_workers_receive_rows_and_new_blocks_but_no_full_tables():
    writer = BlockTableWriter(64, 128)
    seqs = [Sequence(f"r{i}", list(range(1000)), SamplingParams()) for i in range(64)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(100 * i, 100 * i + 63))
    first = build_model_input([ScheduledSeq(s, 1000) for s in seqs], 16, writer)
    for seq in seqs:
        seq.num_computed_tokens = 1000
        seq.append_token(5)
    decode = build_model_input([ScheduledSeq(s, 1) for s in seqs], 16, writer)

    assert decode.block_tables == [] and decode.table_updates == []  # rows only: no lists, no new blocks
    assert len(decode.logits_indices) == 64
    sent = ModelInput.from_bytes(decode.to_bytes())
    assert sent.block_tables == [] and sent.seq_rows == list(range(64))
    assert len(decode.to_bytes()) < len(first.to_bytes()) // 20  # 64 x 63 block ids are not resent
    array = BlockTableArray(64, 128)
    array.apply(ModelInput.from_bytes(first.to_bytes()).table_updates)
    assert np.array_equal(array.gather(sent.seq_rows, 63), np.array([s.block_table for s in seqs]))


def test_a_steps_tables_are_padded_with_block_0_past_each_context_even_in_a_reused_row():
    writer, array = BlockTableWriter(2, 8), BlockTableArray(2, 8)
    array.apply([writer.place(1, [3, 9, 4, 7])[1]])
    writer.retain([])  # sequence 1 ended; its row still holds [3, 9, 4, 7]
    inp = ModelInput(input_ids=[0, 0], positions=[4, 20], query_lens=[1, 1], context_lens=[5, 21],
                     slot_mapping=[0, 0], logits_indices=[0, 1])
    for seq_id, table in ((2, [6, 2]), (3, [5, 1, 8, 11, 12, 13])):
        row, update = writer.place(seq_id, table)
        inp.seq_rows.append(row)
        inp.table_updates.append(update)
    tables = array.take(inp, block_size=4)
    assert tables.dtype == np.int32
    assert tables.tolist() == [[6, 2, 0, 0, 0, 0], [5, 1, 8, 11, 12, 13]]


def test_a_block_given_back_by_rejected_drafts_and_taken_by_another_sequence_is_not_read_again():
    """Sequence a's drafts take a block, are rejected and give it back; b takes that very block,
    then a's next drafts take another one at the same column: the runners must get the new id
    (a count of the blocks they hold cannot tell). The real scheduler, block manager and layout."""
    from kvserve.engine.core.block_manager import BlockManager
    from kvserve.engine.core.scheduler import Scheduler
    from kvserve.engine.model_input import blocks_for

    sched = Scheduler(BlockManager(64, 4, False), 8, 64, 256, [0])
    writer, array = BlockTableWriter(8, 64), BlockTableArray(8, 64)
    a, b = (Sequence(name, list(range(1, n)), SamplingParams(max_tokens=50))
           for name, n in (("a", 8), ("b", 7)))
    sched.add(a)
    sched.add(b)
    given_back: set[int] = set()
    for drafts in ([], [60, 61, 62, 63, 64], [60, 61, 62, 63, 64], [60, 61, 62, 63, 64]):
        a.draft_token_ids = drafts
        out = sched.schedule()
        writer.retain(s.seq_id for s in sched.running)
        inp = ModelInput.from_bytes(build_model_input(out.scheduled, 4, writer).to_bytes())  # as a worker
        tables = array.take(inp, 4)
        by_row = {writer._rows[s.seq.seq_id][0]: s.seq for s in out.scheduled}
        for row, context, table in zip(inp.seq_rows, inp.context_lens, tables, strict=True):
            n = int(blocks_for(context, 4))
            assert table[:n].tolist() == by_row[row].block_table[:n]
        held = set(a.block_table)
        # a rejects every draft (99 sampled at its first); b decodes
        sched.postprocess(out, [[99] if s is a and drafts else 51 for s in out.sampling_seqs])
        given_back |= held - set(a.block_table)
    assert b.block_table[-1] in given_back  # the case happened: b took a block a's drafts had held
