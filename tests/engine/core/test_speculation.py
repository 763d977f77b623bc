"""Speculative decoding end to end on the default model in float32: with n-gram drafts on, every
request gives the tokens and log-probabilities it gives with them off (greedy and seeded sampling,
penalties, top-k/p, min-p, stop strings, max_tokens, n > 1), drafts are actually verified and
accepted, and every KV block is free at the end. Also the seeded-request property speculation
relies on: the same seed and prompt give the same tokens whether the prompt was cached or not."""

from __future__ import annotations

import random

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.sequence import FinishReason
from kvserve.testing.engine import with_control_plane

SOURCE = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
PROMPTS = [
    "Copy this code exactly.\n" + SOURCE + "\nCopy:\n" + SOURCE[:30],
    "List: apples, pears, plums, apples, pears, plums, apples, pears,",
    "Tell me about the sea.",
]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=11, max_tokens=40,
                             repetition_penalty=1.05, presence_penalty=0.2, frequency_penalty=0.1,
                             logprobs=2),
}


@pytest.fixture(scope="module")
def llm():
    # one thread: the bit-identity holds for any thread count, and one does not wait on a busy machine
    llm = LLM("default", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, threads=1)
    yield llm
    llm.shutdown()


@pytest.fixture
def plane(llm):
    """The engine's control plane rebuilt with other settings, restored afterwards."""
    eng = llm.engine
    saved = (eng.config, eng.block_manager, eng.scheduler, eng.speculator)
    yield lambda **changes: with_control_plane(llm, **changes)
    eng.config, eng.block_manager, eng.scheduler, eng.speculator = saved


def _generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs], o.finish_reason, o.text)
            for o in outs]


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(llm, plane, kind):
    params = SAMPLINGS[kind]
    plane(speculative="off")
    plain = [_generate(llm, [p], params)[0] for p in PROMPTS]
    plane(speculative="ngram")
    spec = [_generate(llm, [p], params)[0] for p in PROMPTS]
    stats = llm.stats()
    assert spec == plain
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.engine.block_manager.check_integrity()


def test_stop_strings_ids_and_max_tokens_end_a_run_where_plain_decoding_ends(llm, plane):
    prompt = PROMPTS[0]
    plane(speculative="off")
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    # a stop string and a stop id taken from inside the copied text, and a max_tokens in the middle
    stop_text = full.text[12:18]
    cases = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text], logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[full.token_ids[20]], logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=1)]
    plain = [_generate(llm, [prompt], p)[0] for p in cases]
    plane(speculative="ngram")
    spec = [_generate(llm, [prompt], p)[0] for p in cases]
    assert spec == plain
    assert [s[2] for s in spec] == [FinishReason.STOP_STRING, FinishReason.STOP, FinishReason.LENGTH]
    assert len(spec[2][0]) == 17 and len(spec[0][1]) == len(spec[0][0])
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_n_choices_draft_independently_and_a_request_may_turn_speculation_off(llm, plane):
    params = SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=30)
    plane(speculative="off")
    plain = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    plane(speculative="ngram")
    spec = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in spec.choices] == [c.token_ids for c in plain.choices]
    drafted = llm.stats()["spec_decode_num_draft_tokens"]
    assert drafted > 0
    off = SamplingParams(temperature=0.0, max_tokens=30, speculative="off")
    llm.generate([PROMPTS[0]], off, use_tqdm=False)
    capped = SamplingParams(temperature=0.0, max_tokens=30, max_draft_tokens=0)
    llm.generate([PROMPTS[0]], capped, use_tqdm=False)
    assert llm.stats()["spec_decode_num_draft_tokens"] == drafted


@pytest.mark.slow  # ~14 s; `make test` stays under 15 minutes (the other exactness tests stay in it)
def test_preemption_in_the_middle_of_speculation_recomputes_the_same_tokens(llm, plane):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plane(speculative="off")
    alone = [_generate(llm, [p], params)[0][0] for p in PROMPTS]
    # the prompts take 7 of 9 blocks (block size 16) and need 16 at the end: someone must yield
    plane(speculative="ngram", num_kv_blocks=9)
    squeezed = [o[0] for o in _generate(llm, PROMPTS, params)]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert squeezed == alone
    assert stats["kv_blocks_free"] == 9


def test_same_seed_same_tokens_with_and_without_a_prefix_cache_hit(llm, plane):
    """Issue 29's recipe: a 33-token random prompt, temperature 3, seed 3, 40 tokens, sent several
    times: the first call computes the whole prompt, the later ones find 32 tokens cached."""
    plane()
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(33)]
    params = SamplingParams(temperature=3.0, seed=3, max_tokens=40, ignore_eos=True)
    outs = [llm.generate([ids], params, use_tqdm=False)[0] for _ in range(4)]
    assert [o.cached_tokens for o in outs] == [0, 32, 32, 32]
    assert all(o.token_ids == outs[0].token_ids for o in outs)
