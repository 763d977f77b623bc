"""Sampler: greedy, truncation (top_k / top_p / min_p), seeded draws, penalties, min_tokens, logprobs.

Synthetic logits keep the kept sets and target distributions known exactly. Runs on CPU,
and on CUDA too when it is available.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.layers.sampler import Sampler, _edit_logits
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence

EOS = 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def make_seq(prompt: list[int] | None = None, output: list[int] = (), **params) -> Sequence:
    seq = Sequence("r", list(prompt or [1]), SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


def logits_from_probs(probs: list[float], rows: int, device: str) -> torch.Tensor:
    return torch.tensor(probs, device=device).log().repeat(rows, 1)


def frequencies(token_ids: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(token_ids), minlength=vocab)
    return (counts / len(token_ids)).tolist()


def test_greedy_is_argmax(device):
    vocab = 49152
    logits = torch.randn(6, vocab, device=device, generator=torch.Generator(device).manual_seed(1))
    out = Sampler(vocab, [EOS])(logits, [make_seq(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy_at_any_temperature(device, temperature):
    vocab = 1000
    logits = torch.randn(16, vocab, device=device, generator=torch.Generator(device).manual_seed(2))
    seqs = [make_seq(temperature=temperature, top_k=1) for _ in range(16)]
    assert Sampler(vocab, [EOS])(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy(device):
    vocab = 500
    logits = torch.randn(8, vocab, device=device, generator=torch.Generator(device).manual_seed(3))
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(8)]
    out = Sampler(vocab, [EOS])(logits, seqs).token_ids
    assert out[0::2] == logits.argmax(dim=-1).tolist()[0::2]


def run_steps(
    sampler: Sampler, seq: Sequence, row_logits: torch.Tensor, neighbours: int, pos: int, steps: int
) -> list[int]:
    """Sample ``steps`` tokens for ``seq`` at batch position ``pos`` among unseeded random rows."""
    vocab = row_logits.shape[0]
    noise_gen = torch.Generator(row_logits.device.type).manual_seed(99)
    for _ in range(steps):
        others = torch.randn(neighbours, vocab, device=row_logits.device, generator=noise_gen)
        logits = torch.cat([others[:pos], row_logits.unsqueeze(0), others[pos:]])
        batch = [make_seq(temperature=1.0) for _ in range(neighbours)]
        batch.insert(pos, seq)
        seq.append_token(sampler(logits, batch).token_ids[pos])
    return seq.completion_token_ids


def test_seeded_row_gives_same_tokens_alone_and_in_any_batch(device):
    vocab = 2000
    row = torch.zeros(vocab, device=device)  # flat: every token equally likely, draws differ easily

    def fresh(seed):
        return make_seq(prompt=[5, 6, 7], temperature=1.0, top_p=0.9, seed=seed)

    alone = run_steps(Sampler(vocab, [EOS], seed=0), fresh(1234), row, neighbours=0, pos=0, steps=12)
    among = run_steps(Sampler(vocab, [EOS], seed=7), fresh(1234), row, neighbours=5, pos=3, steps=12)
    first = run_steps(Sampler(vocab, [EOS], seed=7), fresh(1234), row, neighbours=3, pos=0, steps=12)
    other_seed = run_steps(Sampler(vocab, [EOS], seed=0), fresh(4321), row, neighbours=0, pos=0, steps=12)
    assert alone == among == first
    assert alone != other_seed


def test_seeded_row_resumes_after_recompute(device):
    """A preempted sequence is recomputed with its tokens so far; its next draws must not change."""
    vocab = 2000
    row = torch.zeros(vocab, device=device)
    full = run_steps(Sampler(vocab, [EOS]), make_seq(temperature=1.0, seed=5), row, 0, 0, steps=10)
    resumed = make_seq(temperature=1.0, seed=5, output=full[:6])
    assert run_steps(Sampler(vocab, [EOS], seed=3), resumed, row, 2, 1, steps=4) == full


def test_unseeded_rows_differ_between_draws(device):
    vocab = 2000
    out = Sampler(vocab, [EOS])(torch.zeros(8, vocab, device=device), [make_seq() for _ in range(8)])
    assert len(set(out.token_ids)) > 1


PROBS8 = [0.4, 0.3, 0.15, 0.1, 0.03, 0.01, 0.005, 0.005]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_p": 0.75}, {0, 1, 2}),  # mass before token 2 is 0.70 < 0.75, before token 3 is 0.85
        ({"top_p": 0.35}, {0}),
        ({"min_p": 0.2}, {0, 1, 2, 3}),  # p >= 0.2 * 0.4 = 0.08
        ({"min_p": 0.5}, {0, 1}),  # p >= 0.2
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),  # after top_k the mass is renormalised over 0.85
        ({"top_k": 2, "min_p": 0.1, "top_p": 1.0}, {0, 1}),
    ],
)
def test_truncation_never_emits_a_token_outside_the_kept_set(device, params, kept):
    rows = 3000
    seqs = [make_seq(temperature=1.0, **params) for _ in range(rows)]
    out = Sampler(len(PROBS8), [EOS])(logits_from_probs(PROBS8, rows, device), seqs).token_ids
    assert set(out) == kept  # nothing outside, and every kept token does show up


def test_rows_with_different_truncation_share_a_batch(device):
    rows = 1500
    seqs = [make_seq(temperature=1.0, top_p=0.35) for _ in range(rows)]
    seqs += [make_seq(temperature=1.0, top_k=2) for _ in range(rows)]
    seqs += [make_seq(temperature=1.0) for _ in range(rows)]
    out = Sampler(len(PROBS8), [EOS])(logits_from_probs(PROBS8, 3 * rows, device), seqs).token_ids
    assert set(out[:rows]) == {0}
    assert set(out[rows : 2 * rows]) == {0, 1}
    assert len(set(out[2 * rows :])) >= 6


def midpoint_top_p(row: torch.Tensor, last_kept_rank: int, top_k: int = 0) -> float:
    """A top_p that keeps exactly the tokens ranked 0..last_kept_rank (float64 reference)."""
    ordered = row.double().sort(descending=True).values[: top_k or None]
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return float(mass_before[last_kept_rank] + mass_before[last_kept_rank + 1]) / 2


def test_top_p_with_long_and_short_nuclei_in_one_batch(device):
    """Long nuclei (hundreds of tokens) and short ones, with and without top_k, next to an
    untruncated row; the kept set is found by value, wherever the tokens sit."""
    vocab, rows = 3000, 400
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))
    flat = (-torch.arange(vocab) * 0.002)[perm.argsort()]  # token perm[r] has rank r
    steep = (-torch.arange(vocab) * 0.5)[perm.argsort()]
    cases = [
        (flat, {"top_p": midpoint_top_p(flat, 700)}, 700),
        (steep, {"top_p": midpoint_top_p(steep, 3)}, 3),
        (flat, {"top_k": 600, "top_p": midpoint_top_p(flat, 400, top_k=600)}, 400),
        (flat, {}, vocab - 1),  # untruncated: the tail is rare here, but it is drawn
    ]
    logits = torch.cat([row.repeat(rows, 1) for row, _, _ in cases]).to(device)
    seqs = [make_seq(temperature=1.0, **params) for _, params, _ in cases for _ in range(rows)]
    out = Sampler(vocab, [EOS])(logits, seqs).token_ids
    rank = perm.argsort().tolist()
    for c, (_, _, last) in enumerate(cases):
        ranks = [rank[t] for t in out[c * rows : (c + 1) * rows]]
        assert max(ranks) <= last
        assert max(ranks) >= min(last - min(40, last), 2000)  # the tail of the nucleus is not cut off


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_temperature_scaled_distribution(device, temperature):
    probs = [0.5, 0.25, 0.15, 0.1]
    rows = 20000
    seqs = [make_seq(temperature=temperature) for _ in range(rows)]
    out = Sampler(len(probs), [EOS], seed=11)(logits_from_probs(probs, rows, device), seqs).token_ids
    scaled = [p ** (1 / temperature) for p in probs]
    expected = [s / sum(scaled) for s in scaled]
    for got, want in zip(frequencies(out, len(probs)), expected, strict=True):
        assert abs(got - want) < 0.02  # > 5 standard deviations at n = 20000


def greedy_choice(device, values: dict[int, float], **seq_kwargs) -> int:
    vocab = 16
    logits = torch.full((1, vocab), -20.0, device=device)
    for token, value in values.items():
        logits[0, token] = value
    return Sampler(vocab, [EOS])(logits, [make_seq(temperature=0.0, **seq_kwargs)]).token_ids[0]


def assert_penalised_value(device, logit: float, expected: float, **seq_kwargs):
    """Token 5 (raw ``logit``) must land at ``expected``: a rival just below loses, just above wins."""
    assert greedy_choice(device, {5: logit, 6: expected - 0.01}, **seq_kwargs) == 5
    assert greedy_choice(device, {5: logit, 6: expected + 0.01}, **seq_kwargs) == 6


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(device):
    assert_penalised_value(device, 2.0, 2.0 / 1.5, prompt=[5], repetition_penalty=1.5)
    assert_penalised_value(device, -1.0, -1.5, prompt=[5], repetition_penalty=1.5)
    assert_penalised_value(device, 2.0, 2.0 / 1.5, prompt=[1], output=[5], repetition_penalty=1.5)
    assert_penalised_value(device, 2.0, 2.0, prompt=[1], output=[7], repetition_penalty=1.5)


def test_presence_and_frequency_penalties_count_output_tokens_only(device):
    out = [5, 5, 5, 9]
    assert_penalised_value(device, 2.0, 2.0 - 3 * 0.3, output=out, frequency_penalty=0.3)
    assert_penalised_value(device, 2.0, 2.0 - 0.4, output=out, presence_penalty=0.4)
    both = {"frequency_penalty": 0.3, "presence_penalty": 0.4}
    assert_penalised_value(device, 2.0, 2.0 - 0.9 - 0.4, output=out, **both)
    assert_penalised_value(device, 2.0, 2.0 + 0.5, output=out, presence_penalty=-0.5)
    assert_penalised_value(device, 2.0, 2.0, prompt=[5, 5], presence_penalty=1.0, frequency_penalty=1.0)


def test_min_tokens_masks_eos_and_stop_ids_until_reached(device):
    values = {EOS: 9.0, 11: 8.0, 4: 1.0}
    assert greedy_choice(device, values, min_tokens=2, stop_token_ids=[11]) == 4
    assert greedy_choice(device, values, min_tokens=2, stop_token_ids=[11], output=[3]) == 4
    assert greedy_choice(device, values, min_tokens=2, stop_token_ids=[11], output=[3, 3]) == EOS
    assert greedy_choice(device, values, min_tokens=2) == 11
    # under ignore_eos, EOS does not end the request, so it stays allowed
    assert greedy_choice(device, values, min_tokens=2, stop_token_ids=[11], ignore_eos=True) == EOS


def test_min_tokens_mask_holds_for_random_rows(device):
    rows = 2000
    probs = [0.1, 0.1, 0.5, 0.3]  # EOS (2) most likely, 3 is a stop id
    seqs = [make_seq(temperature=1.0, min_tokens=1, stop_token_ids=[3]) for _ in range(rows)]
    out = Sampler(4, [EOS])(logits_from_probs(probs, rows, device), seqs).token_ids
    assert set(out) == {0, 1}


def test_logprobs_are_sorted_log_softmax_of_the_raw_logits(device):
    vocab = 300
    logits = torch.randn(3, vocab, device=device, generator=torch.Generator(device).manual_seed(4)) * 3
    seqs = [
        make_seq(temperature=0.0, logprobs=5, repetition_penalty=2.0, prompt=list(range(50))),
        make_seq(temperature=0.7, logprobs=0),
        make_seq(temperature=1.3, top_k=10, logprobs=20, seed=3),
    ]
    out = Sampler(vocab, [EOS])(logits, seqs)
    reference = torch.log_softmax(logits.double().cpu(), dim=-1)
    assert out.logprobs[1] is None
    for row, n in ((0, 5), (2, 20)):
        entry = out.logprobs[row]
        assert entry.token_id == out.token_ids[row]
        assert math.isclose(entry.logprob, reference[row, entry.token_id].item(), abs_tol=1e-4)
        assert len(entry.top) == n
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        best = reference[row].topk(n)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        for (_, got), want in zip(entry.top, best.values.tolist(), strict=True):
            assert math.isclose(got, want, abs_tol=1e-4)


def test_logits_wider_than_vocab_are_cut_and_input_is_not_modified(device):
    vocab = 10
    logits = torch.zeros(2, 16, device=device)
    logits[:, 12] = 50.0  # padding column beyond the vocabulary
    logits[0, 5] = 3.0
    logits[1, 2], logits[1, 3] = 1.0, 0.9
    before = logits.clone()
    # ids beyond the vocabulary in a penalised row must not reach the next row (12 = 1 * 10 + 2)
    seqs = [
        make_seq(temperature=0.0, prompt=[5, 12], output=[14], repetition_penalty=2.0, presence_penalty=-2.0),
        make_seq(temperature=0.0),
    ]
    assert Sampler(vocab, [EOS])(logits, seqs).token_ids == [5, 2]
    assert torch.equal(logits, before)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="num_seqs=2"):
        Sampler(8, [EOS])(torch.zeros(3, 8), [make_seq(), make_seq()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_before_the_ids_are_read():
    vocab = 49152
    logits = torch.randn(6, vocab, device="cuda")
    seqs = [
        make_seq(temperature=0.0, repetition_penalty=1.2, min_tokens=3),
        make_seq(temperature=0.8, top_p=0.9, seed=1),
        make_seq(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
        make_seq(temperature=1.0, presence_penalty=0.5, output=[3, 4, 4]),
        make_seq(temperature=0.7, top_k=20),
        make_seq(temperature=0.0, logprobs=3),
    ]
    sampler = Sampler(vocab, [EOS])
    sampler(logits, seqs)  # warm-up: generators, pinned buffers
    batch = sampler.prepare(seqs)  # host values only, built before the step's model runs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids = sampler._choose(_edit_logits(logits, batch), batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert token_ids.shape == (6,)
