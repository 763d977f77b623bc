"""Speculative verification steps on the GPU path: the Triton backend (under Triton's interpreter on
the CPU) with decode graphs, captured by a recorder whose replay re-runs the captured body (what a
CUDA graph does; see test_model_runner_graphs.py).

A verification step lays a sequence out as one decode row per query token (its last token, then
each draft; ``model_input._add_verification_rows``): every row has query length 1 and its own
context length, so a step of verifications alone is decode-only. It takes the paged decode kernel
and replays the smallest decode graph that holds its rows, uniform (1 + k rows per sequence) or not;
more rows than the largest graph, or a prefill chunk in the step (which sends the whole step through
the varlen prefill kernel), run eagerly. Checked here: the rows' positions, slots and context
lengths; graph logits equal eager ones; each row's logits equal those of a plain one-token decode
step of that token after the same committed tokens, also after rejected drafts left their K/V
behind; and a whole engine with n-gram speculation on generates the greedy tokens and logprobs of
one with it off, its verification steps replaying graphs.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.step_time import ScheduledSeq
from kvserve.engine.model_input import BlockTableWriter, ModelInput, build_model_input
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
from kvserve.testing.graph_recorder import BLOCK, MAX_NUM_SEQS, FakeGraph, triton_runner_config

pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

TOL = dict(atol=1e-5, rtol=1e-5)


def recorder(body, pool):
    return FakeGraph(body)


def replays(runner) -> int:
    return sum(graph.replays for graph in runner.graphs.graphs.values())


def runner_config(model_dir, **changes) -> EngineConfig:
    return triton_runner_config(model_dir, 16, **changes)


class Twin:
    """One sequence in the speculating runners and its twin in the plain runner: the same prompt,
    the same four blocks (from block 1 on: padding points at block 0), the same committed tokens."""

    def __init__(self, index: int, prompt_len: int):
        prompt = [(7 * index + 3 * j + 1) % 10240 for j in range(prompt_len)]
        self.spec, self.plain = (Sequence(f"{kind}{index}", prompt, SamplingParams()) for kind in "sp")
        self.spec.block_table = self.plain.block_table = list(range(1 + 4 * index, 5 + 4 * index))


class Harness:
    def __init__(self, model_dir):
        self.graphed = ModelRunner(runner_config(model_dir), record_graph=recorder)
        self.eager = ModelRunner(runner_config(model_dir, enforce_eager=True))
        self.plain = ModelRunner(runner_config(model_dir, enforce_eager=True))
        self.writers = {"spec": BlockTableWriter(MAX_NUM_SEQS, 4), "plain": BlockTableWriter(MAX_NUM_SEQS, 4)}

    def step(self, work: list[tuple[Twin, list[int] | None]], keep: list[int]) -> bool:
        """One speculating step: ``(twin, drafts)`` verifies the drafts (``None``: the twin's
        prompt is prefilled); then the first ``keep[i]`` drafts are committed with the token the
        row after them gives, as sample-then-match does. Checks the layout, graph against eager,
        and each committed row against a plain decode step; returns whether a graph ran."""
        scheduled = [ScheduledSeq(t.spec, t.spec.num_tokens) if d is None
                     else ScheduledSeq(t.spec, 1 + len(d), d) for t, d in work]  # fmt: skip
        inp = build_model_input(scheduled, BLOCK, self.writers["spec"])
        row = entry = 0  # the step's first token, and its first (query length, context length) entry
        for t, drafts in work:
            if drafts is None:
                assert (inp.query_lens[entry], inp.context_lens[entry]) == (t.spec.num_tokens,) * 2
                row, entry = row + t.spec.num_tokens, entry + 1
                continue
            start, table = t.spec.num_computed_tokens, t.spec.block_table
            rows = range(row, row + 1 + len(drafts))
            positions = [start + j for j in range(len(rows))]
            assert [inp.positions[r] for r in rows] == positions
            assert [inp.input_ids[r] for r in rows] == [t.spec.last_token, *drafts]
            slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
            assert [inp.slot_mapping[r] for r in rows] == slots
            entries = range(entry, entry + len(rows))
            assert [(inp.query_lens[e], inp.context_lens[e]) for e in entries] == [(1, p + 1)
                                                                                   for p in positions]
            row, entry = row + len(rows), entry + len(rows)
        decode_only = inp.is_decode_only
        before = replays(self.graphed)
        ours = self.graphed.execute_model(ModelInput.from_bytes(inp.to_bytes()))
        theirs = self.eager.execute_model(ModelInput.from_bytes(inp.to_bytes()))
        torch.testing.assert_close(ours, theirs, **TOL)
        graphed = replays(self.graphed) > before
        assert graphed == (decode_only and len(inp.input_ids) <= MAX_NUM_SEQS)
        logits_row = 0
        for (t, drafts), kept in zip(work, keep, strict=True):
            rows = ours[logits_row : logits_row + 1 + len(drafts or [])]
            logits_row += len(rows)
            self.commit(t, drafts or [], kept, rows)
        return graphed

    def commit(self, t: Twin, drafts: list[int], kept: int, rows: torch.Tensor) -> None:
        """Commit ``drafts[:kept]`` and the token row ``kept`` gives; the plain runner computes the
        same tokens one decode step each (a prefill as a prefill) and must give the same rows."""
        seq, plain = t.spec, t.plain
        prefill = seq.num_computed_tokens == 0
        run = [*drafts[:kept], int(rows[kept].argmax())]
        for j in range(kept + 1):
            scheduled = [ScheduledSeq(plain, plain.num_tokens if prefill else 1)]
            logits = self.plain.execute_model(build_model_input(scheduled, BLOCK, self.writers["plain"]))
            torch.testing.assert_close(logits[0], rows[j], **TOL)
            plain.num_computed_tokens = plain.num_tokens
            plain.append_token(run[j])
        seq.token_ids += run
        seq.num_computed_tokens = seq.num_tokens - 1
        assert seq.token_ids == plain.token_ids and seq.num_computed_tokens == plain.num_computed_tokens

    def shutdown(self):
        for runner in (self.graphed, self.eager, self.plain):
            runner.shutdown()


def test_verification_rows_replay_decode_graphs_and_give_plain_decoding_logits(model_dir):
    h = Harness(model_dir)
    a, b, c = Twin(0, 14), Twin(1, 9), Twin(2, 12)
    try:
        assert h.graphed.graphs.captured == [1, 2, 4] and h.eager.graphs is None
        assert not h.step([(a, None), (b, None)], [0, 0])  # prefill: eager
        # uniform, 1 + 1 rows each: the 4-row graph
        assert h.step([(a, [501]), (b, [502])], [1, 0])
        # not uniform but 4 rows: still a graph; a's rows open its second block, its drafts rejected
        assert h.step([(a, [503, 504]), (b, [])], [0, 0])
        # 4 + 3 rows: more than the largest graph, eager; a's rows overwrite the rejected slots
        assert not h.step([(a, [505, 506, 507]), (b, [508, 509])], [3, 1])
        # a prefill chunk in the step (the scheduler never sends one with drafts): the varlen prefill
        # kernel for every row, eager
        assert not h.step([(a, [510]), (c, None), (b, [])], [1, 0, 0])
        assert h.step([(c, [511]), (a, [])], [1, 0])
    finally:
        h.shutdown()


def test_an_engine_speculating_through_graphs_gives_the_tokens_of_plain_decoding(model_dir):
    """Greedy with a small frequency penalty: the random model then repeats each token a few times
    and moves on, so n-gram drafts are both accepted and rejected. On a GPU with real CUDA graphs
    (the runner captures them itself; not run here yet), on the CPU with the recorder."""
    from kvserve.engine import LLM
    from kvserve.testing.engine import with_control_plane

    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", block_size=BLOCK, max_num_seqs=4,
              max_model_len=128, num_kv_blocks=32)  # fmt: skip
    runner = llm.engine.executor
    fake = runner.graphs is None
    if fake:  # on the CPU: what a CUDA runner does at start-up, with the recorder for capture
        runner.graphs = runner._new_graph_runner(recorder)
        runner.graphs.capture()
    steps: list[tuple[bool, bool]] = []  # per step: (verifies drafts, runs as a graph)
    execute = runner.execute_model

    def recording(inp):
        logits = execute(inp)  # (which cuts the step's block tables that ``fits`` reads)
        steps.append((len(set(inp.seq_rows)) < len(inp.seq_rows), runner.graphs.fits(inp)))
        return logits

    runner.execute_model = recording
    prompts = [[(7 * j) % 50 + 100 for j in range(24)], [(13 * j) % 10240 for j in range(30)]]
    # one draft a request: two requests' verification (4 rows) fits the largest graph (4 rows at
    # max_num_seqs 4), whatever draft count the interpreter's step costs would favour
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1,
                            frequency_penalty=0.3, max_draft_tokens=1)
    outputs = {}
    try:
        for mode in ("off", "ngram"):
            with_control_plane(llm, speculative=mode)
            outputs[mode] = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        replayed = replays(runner) if fake else None
    finally:
        llm.shutdown()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert (True, True) in steps  # a verification step ran as a decode graph
    if fake:
        assert replayed == sum(graphed for _, graphed in steps)
    for spec, plain in zip(outputs["ngram"], outputs["off"], strict=True):
        assert spec.token_ids == plain.token_ids
        ours, theirs = ([lp.logprob for lp in out.logprobs] for out in (spec, plain))
        assert len(ours) == 16 and ours == pytest.approx(theirs, abs=1e-4)
