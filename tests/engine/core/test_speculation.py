"""Speculative decoding end to end on the default model in float32: with n-gram drafts on, every
request gives the tokens and log-probabilities it gives with them off (greedy and seeded sampling,
penalties, top-k/p, min-p, stop strings, max_tokens, n > 1), drafts are actually verified and
accepted, and every KV block is free at the end. Constrained (JSON schema) requests draft too (the
grammar's forced tokens and n-gram drafts, ``structured/drafts.py``), with the same tokens and
log-probabilities as without, and never verify a draft their grammar forbids. Also the
seeded-request property speculation relies on: the same seed and prompt give the same tokens
whether the prompt was cached or not."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import xgrammar as xgr

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.constraints import constraint_of
from kvserve.engine.sequence import FinishReason
from kvserve.engine.spec_decode.ngram import NgramIndex
from kvserve.engine.spec_decode.policy import StepCosts
from kvserve.engine.structured.drafts import valid_prefix
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

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "color": {"enum": ["red", "green", "yellow"]},
    "count": {"type": "integer"}}, "required": ["name", "color", "count"], "additionalProperties": False})
# the prompt's JSON says "colour" where the schema wants "color": copied n-gram drafts meet the grammar
JSON_TASKS = ["Describe a fruit as JSON.", 'Copy this JSON: {"name": "Kiwi", "colour": "green", "count": 7}',
              "Give me a JSON fruit with a name, a color and a count."]


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


def _off_and_on(llm, plane, prompts, params, mode: str, together: bool = False, **config):
    """Each prompt alone without speculation, then with ``mode`` in an engine built with ``config``
    (each prompt alone, or all at once); (the plain outputs, the speculative ones, the stats after)."""
    plane(speculative="off")
    plain = [_generate(llm, [p], params)[0] for p in prompts]
    plane(speculative=mode, **config)
    spec = _generate(llm, prompts, params) if together else [_generate(llm, [p], params)[0] for p in prompts]
    return plain, spec, llm.stats()


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(llm, plane, kind):
    params = SAMPLINGS[kind]
    plain, spec, stats = _off_and_on(llm, plane, PROMPTS, params, "ngram")
    assert spec == plain
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
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
    # both arms from an empty prefix cache: with the first run's blocks cached, the plain arm would
    # prefill 13 tokens where the speculative one prefills 61, and float32 GEMMs of other row counts
    # may round differently (MKL's AVX-512 kernels below 16 rows: docs/serving/speculative.md)
    plane(speculative="off")
    plain = [_generate(llm, [prompt], p)[0] for p in cases]
    plane(speculative="ngram")
    spec = [_generate(llm, [prompt], p)[0] for p in cases]
    assert spec == plain
    assert [s[2] for s in spec] == [FinishReason.STOP_STRING, FinishReason.STOP, FinishReason.LENGTH]
    assert len(spec[2][0]) == 17 and len(spec[0][1]) == len(spec[0][0])
    assert llm.stats().spec_decode_num_accepted_tokens > 0


def test_n_choices_draft_independently_and_a_request_may_turn_speculation_off(llm, plane):
    params = SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=30)
    plane(speculative="off")
    plain = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    plane(speculative="ngram")
    spec = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in spec.choices] == [c.token_ids for c in plain.choices]
    drafted = llm.stats().spec_decode_num_draft_tokens
    assert drafted > 0
    off = SamplingParams(temperature=0.0, max_tokens=30, speculative="off")
    llm.generate([PROMPTS[0]], off, use_tqdm=False)
    capped = SamplingParams(temperature=0.0, max_tokens=30, max_draft_tokens=0)
    llm.generate([PROMPTS[0]], capped, use_tqdm=False)
    assert llm.stats().spec_decode_num_draft_tokens == drafted


@pytest.mark.slow  # ~14 s; `make test` stays under 15 minutes (the other exactness tests stay in it)
def test_preemption_in_the_middle_of_speculation_recomputes_the_same_tokens(llm, plane):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # the prompts take 7 of 9 blocks (block size 16) and need 16 at the end: someone must yield
    plain, spec, stats = _off_and_on(llm, plane, PROMPTS, params, "ngram", together=True, num_kv_blocks=9)
    alone, squeezed = [o[0] for o in plain], [o[0] for o in spec]  # the tokens
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    assert squeezed == alone
    assert stats.kv_blocks_free == 9


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


def _chat(llm, text: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": text}])


def _assert_nothing_left(llm, blocks: int | None = None) -> None:
    stats = llm.stats()
    assert stats.kv_blocks_free == (blocks or stats.kv_blocks_total)
    llm.engine.block_manager.check_integrity()
    assert not llm.engine.requests and not llm.engine.structured._matchers


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_constrained_requests_draft_and_keep_the_tokens_and_logprobs_of_plain_decoding(llm, plane, kind):
    params = dataclasses.replace(SAMPLINGS[kind], json_schema=SCHEMA)
    prompts = [_chat(llm, t) for t in JSON_TASKS[:2]]
    plain, spec, stats = _off_and_on(llm, plane, prompts, params, "all")
    assert spec == plain
    assert [s[2] for s in spec] == [FinishReason.STOP] * 2  # complete JSON, ended by the grammar's EOS
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    _assert_nothing_left(llm)


def test_a_draft_the_grammar_forbids_is_never_verified(llm, plane):
    """The prompt-lookup drafts copy the prompt's "colour" and its end-of-turn token (and what follows
    it): every draft sequence verified is one the grammar accepts in turn at its position."""
    params = SamplingParams(temperature=0.0, max_tokens=40, json_schema=SCHEMA, logprobs=1)
    prompt = _chat(llm, JSON_TASKS[1])
    plane(speculative="off")
    plain = _generate(llm, [prompt], params)[0]
    plane(speculative="ngram")
    verified, runs = [], llm.engine.speculator.runs
    llm.engine.speculator.runs = lambda scheduled, rows: (
        verified.extend((s.seq.num_tokens, s.drafts) for s in scheduled if s.drafts) or runs(scheduled, rows))
    out = _generate(llm, [prompt], params)[0]
    assert out == plain and out[2] == FinishReason.STOP
    assert verified and any(set(d) & set(llm.engine.eos_token_ids) for _, d in verified)  # a drafted EOS
    tokens = prompt + out[0]
    grammar = llm.engine.structured.compile(constraint_of(params))
    for end, drafts in verified:
        matcher = xgr.GrammarMatcher(grammar)
        assert all(map(matcher.accept_token, tokens[len(prompt) : end]))
        assert valid_prefix(matcher, drafts) == len(drafts)
    # and the n-gram index did propose drafts the grammar refuses: the cut is what kept them out
    matcher, index, refused = xgr.GrammarMatcher(grammar), NgramIndex(2, 5), 0
    for end in range(len(prompt), len(tokens)):
        raw, _ = index.propose(tokens[:end], 5)
        refused += valid_prefix(matcher, raw) < len(raw)
        matcher.accept_token(tokens[end])
    assert refused > 0
    _assert_nothing_left(llm)


def test_preemption_and_abort_of_constrained_drafting_sequences_leave_no_matcher_or_block(llm, plane):
    params = SamplingParams(temperature=0.0, max_tokens=40, json_schema=SCHEMA)
    prompts = [_chat(llm, t) for t in JSON_TASKS]
    # the prompts take 10 blocks of 16 tokens, and their JSON needs 2 more: someone must yield
    plain, spec, stats = _off_and_on(llm, plane, prompts, params, "all", together=True, num_kv_blocks=10)
    alone, squeezed = [o[0] for o in plain], [o[0] for o in spec]  # the tokens
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert squeezed == alone
    _assert_nothing_left(llm, blocks=10)
    plane(speculative="all")
    eng = llm.engine
    eng.add_request("drafting", prompts[0], params)
    for _ in range(20):  # until a verification ran, then abort in the middle of the output
        eng.step()
        if eng.speculator.counters["spec_decode_num_draft_tokens"]:
            break
    assert eng.structured._matchers and eng.requests
    assert eng.abort("drafting")
    assert [o.finish_reason for o in eng.step()] == [FinishReason.ABORT]
    _assert_nothing_left(llm)


def test_where_the_fused_decode_step_does_not_run_speculation_still_gives_plain_decodings_bits(tmp_path):
    """Qwen3's layers (q/k norms) are not the fused decode step's: a speculating runner then has its
    projections compute a decode-only step's rows one by one alike (``cpu_matmul.RowsAlike``), so the
    verification rows are plain rows bit for bit (before, rows 2..8 went through another GEMM and the
    logprobs moved in the last bit). Two servers of a tiny random Qwen3, speculation off and on; the
    same holds under tensor parallelism (executor/test_tp_speculation.py, slow)."""
    import torch

    from kvserve.testing.random_model import write_random_model

    model = write_random_model("qwen3-tiny", tmp_path / "qwen3-tiny", dtype=torch.float32)
    prompts = [[(7 * j) % 50 + 100 for j in range(24)], [5, 6, 7, 8, 9] * 6]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.3,
                             logprobs=2),
              SamplingParams(temperature=0.5, top_k=40, seed=7, max_tokens=24, ignore_eos=True,
                             frequency_penalty=0.3, logprobs=2)]
    runs = {}
    for mode in ("off", "ngram"):
        llm = LLM(str(model), dtype="float32", max_num_seqs=4, max_model_len=256, num_kv_blocks=64,
                  speculative=mode)
        with_control_plane(llm, speculative=mode)  # the fixed step-cost table, not the start-up's
        runs[mode] = [_generate(llm, [prompt], p)[0] for p in params for prompt in prompts]
        stats = llm.stats()
        llm.shutdown()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert runs["ngram"] == runs["off"]


def test_where_every_projection_is_in_gemm_c_a_small_batch_drafts_past_eight_rows():
    """bfloat16 weights all packed for csrc/gemm.c compute a row alike at any number of rows, so a
    batch of up to MAX_FUSED_ROWS sequences may verify drafts past that many rows and still give
    each sequence the tokens and logprobs it gets alone without speculation."""
    from kvserve.engine.layers.gguf_linear import PANEL_FROM_ROWS
    from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS
    from kvserve.kernels.cpu.bindings import load_kernels

    if load_kernels() is None or not load_kernels().gemm_available():
        pytest.skip("csrc/gemm.c is built only where the compiler targets AVX-512 or AVX2")
    llm = LLM("default", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=512, speculative="ngram")
    try:
        # every projection packed for gemm.c, the tied Q8_0 table in the GGUF block kernels: rows
        # alike up to the count where a product turns to dequantized panels
        assert llm.engine.speculator.exact_rows == PANEL_FROM_ROWS - 1
        # a cost table under which drafts always pay, so that steps of 4 sequences verify 5 each
        with_control_plane(llm, step_costs=StepCosts({1: 1.0, 64: 1.01}), speculative="ngram")
        rows = []
        execute = llm.engine.executor.execute_model

        def counted(inp):  # decode steps' rows (a verification's rows are decode rows too)
            if max(inp.query_lens) == 1:
                rows.append(len(inp.input_ids))
            return execute(inp)

        llm.engine.executor.execute_model = counted
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
        text = "one two three four five six seven eight nine ten " * 3
        prompts = [f"Repeat: {text}", f"Say again: {text}", f"Copy: {text}", f"Echo: {text}"]
        spec = _generate(llm, prompts, params)
        assert max(rows) > MAX_FUSED_ROWS and llm.stats().spec_decode_num_accepted_tokens > 0
        with_control_plane(llm, speculative="off")
        assert spec == [_generate(llm, [p], params)[0] for p in prompts]
    finally:
        llm.shutdown()
