"""Decode graphs of a hybrid (Qwen3.5: Gated DeltaNet + full attention) with the state slots as
static buffers (engine/runner/cuda_graphs.py).

A tiny random Qwen3.5 in float32 (linear layers scaled so that their state steers the tokens)
runs on the Triton backend (its interpreter on the CPU) twice: with decode graphs, captured by the
recorder whose replay re-runs the captured body on the same static buffers (what a CUDA graph
does: the slot numbers come from the static buffer, not from the step's list), and with
``enforce_eager``. Sequences sit on scattered slots; a graph step must give the eager logits and
leave every slot's conv window and recurrent state as the eager step does, its padded rows
stepping only the scratch row.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.testing.engine import scaled_hybrid_model
from kvserve.testing.graph_recorder import Recorder, Seq, step, triton_runner_config

pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

PROMPT_LENS = (7, 18, 3, 33, 12)  # five sequences: one more than the largest captured size (4)
SLOTS = (3, 0, 2, 1, 4)  # the state slot of each: not in order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return scaled_hybrid_model("qwen3.5-tiny", tmp_path_factory.mktemp("qwen3.5-graphs"))


@pytest.fixture(scope="module")
def runners(model_dir):
    """(graphed, eager) runners, five slots each (scratch row besides for the graphed one), every
    PROMPT_LENS prompt prefilled (eagerly: a prefill never replays a graph)."""
    config = dict(max_num_seqs=5, max_model_len=64)
    graphed = ModelRunner(triton_runner_config(model_dir, 24, **config), record_graph=Recorder())
    eager = ModelRunner(triton_runner_config(model_dir, 24, enforce_eager=True, **config),
                        record_graph=Recorder())
    seqs = [Seq(i, n, SLOTS[i]) for i, n in enumerate(PROMPT_LENS)]
    prefill = step(seqs, [s.prompt for s in seqs])
    for runner in (graphed, eager):
        runner.execute_model(prefill)
    yield graphed, eager, seqs
    graphed.shutdown()
    eager.shutdown()


def replays(runner: ModelRunner) -> int:
    return sum(graph.replays for graph in runner.graphs.graphs.values())


def assert_states_equal(graphed: ModelRunner, eager: ModelRunner) -> None:
    """Every slot row of every linear layer (the graphed cache's scratch row aside) as eager's."""
    ours, theirs = graphed.state_cache, eager.state_cache
    rows = theirs.conv.shape[1]
    assert ours.pad_row == rows and theirs.pad_row is None  # one row more, last
    # (a padded batch's projections may sum in another order: float32 rounding, not a wrong slot)
    torch.testing.assert_close(ours.conv[:, :rows], theirs.conv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.recurrent[:, :rows], theirs.recurrent, atol=1e-4, rtol=1e-4)


def run_both(graphed: ModelRunner, eager: ModelRunner, inp: ModelInput) -> torch.Tensor:
    ours, theirs = graphed.execute_model(inp), eager.execute_model(inp)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert_states_equal(graphed, eager)
    return ours


def test_a_hybrid_captures_decode_graphs_with_a_static_slot_buffer(runners):
    graphed, eager, _ = runners
    assert graphed.graphs.captured == [1, 2, 4, 8]  # max_num_seqs 5
    assert graphed.graphs.static.state_slots.shape == (8,)
    cache = graphed.state_cache
    # after the five slots and the five snapshot rows (prefix caching is on by default)
    assert graphed.graphs.state_pad_row == cache.pad_row == cache.num_slots + cache.num_snapshots == 10
    assert eager.graphs is None
    assert_states_equal(graphed, eager)  # the prefill left the same states


def test_decode_replays_with_the_eager_logits_and_states_padded_rows_touch_no_slot(runners):
    graphed, eager, seqs = runners
    before = replays(graphed)
    untouched = [seqs[3].slot, seqs[4].slot]
    cache = graphed.state_cache
    kept = (cache.conv[:, untouched].clone(), cache.recurrent[:, untouched].clone())
    run_both(graphed, eager, step(seqs[:3], [[11], [12], [13]]))  # 3 rows on slots 3, 0, 2: padded to 4
    assert replays(graphed) == before + 1
    pad = graphed.state_cache.pad_row
    assert graphed.graphs.static.state_slots[:4].tolist() == [3, 0, 2, pad]  # the padded row: scratch
    # the slots of the sequences not in the step kept their states
    assert torch.equal(graphed.state_cache.conv[:, untouched], kept[0])
    assert torch.equal(graphed.state_cache.recurrent[:, untouched], kept[1])
    run_both(graphed, eager, step([seqs[4], seqs[1]], [[14], [15]]))  # slots 4, 0: the graph of 2
    assert replays(graphed) == before + 2


def test_greedy_decode_through_graphs_follows_the_eager_tokens_and_states(runners):
    graphed, eager, seqs = runners
    group = [seqs[3], seqs[0], seqs[2], seqs[4], seqs[1]]  # all five: padded to 8
    tokens = {"graphed": [[5]] * 5, "eager": [[5]] * 5}
    before = replays(graphed)
    for _ in range(3):
        inp = step(group, tokens["graphed"])
        for name, runner in (("graphed", graphed), ("eager", eager)):
            tokens[name] = [[t] for t in runner.execute_model(inp).argmax(-1).tolist()]
        assert tokens["graphed"] == tokens["eager"]
        assert_states_equal(graphed, eager)
    assert replays(graphed) == before + 3


def test_rows_sharing_a_slot_and_prefill_chunks_run_eagerly(runners):
    """A verification's rows (one slot, several rows) step the slot in turn: never a graph."""
    graphed, eager, seqs = runners
    before = replays(graphed)
    verify = step([seqs[2]], [[21]])
    second = step([seqs[2]], [[22]])  # the draft after it, as the verification's second row
    for name in ("input_ids", "positions", "slot_mapping", "query_lens", "context_lens", "block_tables",
                 "state_slots"):
        getattr(verify, name).extend(getattr(second, name))
    verify.logits_indices = [0, 1]
    assert not graphed.graphs.fits(verify)
    run_both(graphed, eager, verify)
    run_both(graphed, eager, step(seqs[:2], [[31, 32], [33]]))  # a two-token chunk: not decode-only
    assert replays(graphed) == before
