"""The engine end to end on the default model, in float32.

Greedy tokens equal Hugging Face transformers' on the same weights, and do not change with
prefix caching, forced preemption, forced chunking or other requests in the batch. After
everything finishes or is aborted, every KV block is free.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from kvserve.engine.core.llm_engine import LLMEngine
from kvserve.engine.sequence import FinishReason
from kvserve.testing.engine import with_control_plane

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
NEAR_TIE = 1e-3  # logit margin under which float rounding may flip the argmax

CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
LONG = " ".join(
    f"Paragraph {i}: the river carried boats of grain, salt and timber to the markets of the coast."
    for i in range(20)
)  # > 300 tokens


@pytest.fixture(scope="module")
def llm():
    llm = LLM("default", dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    chat = llm.engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return [
        "Hello",
        "The three primary colors are",
        CODE,
        LONG,
        chat,
        "Translate to French: I like apples.\nFrench:",
    ]


@pytest.fixture
def fresh(llm):
    """The shared engine with a fresh control plane, restored afterwards."""
    eng = llm.engine
    saved = (eng.config, eng.block_manager, eng.scheduler)
    yield lambda **changes: with_control_plane(llm, **changes)
    eng.config, eng.block_manager, eng.scheduler = saved


def hf_reference(model, prompt_ids: list[list[int]], n: int):
    """Greedy tokens from transformers and, per step, the top-2 logit margin."""
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
            refs.append((tokens, margins))
    return refs


def test_greedy_matches_transformers(llm, prompts, hf_default_model):
    ids = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in prompts]
    assert len(ids[3]) > 300
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = llm.generate(ids, params, use_tqdm=False)
    for out, (ref, margins) in zip(ours, hf_reference(hf_default_model, ids, 32), strict=True):
        n = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(ref))
        assert n >= 8, f"reference has a near-tie too early ({n})"
        assert out.token_ids[:n] == ref[:n]


def test_an_engine_on_the_cpu_resolves_the_default_token_budget():
    llm = LLM("default", dtype="float32", num_kv_blocks=16, max_model_len=256)
    try:
        assert llm.engine.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS  # unset
        assert llm.engine.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    finally:
        llm.shutdown()


def test_chat_answer_mentions_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)
    assert "Paris" in out.text
    assert out.finish_reason == FinishReason.STOP  # <|im_end|> ends the turn


def test_prefix_cache_hit_gives_same_tokens(llm, fresh, prompts):
    shared = llm.tokenizer.encode(LONG)[:200]
    tails = [llm.tokenizer.encode(t) for t in (" Summarise:", " In short,", " The end.")]
    reqs = [shared + t for t in tails]
    fresh(enable_prefix_caching=False)
    cold = llm.generate(reqs, GREEDY, use_tqdm=False)
    fresh(enable_prefix_caching=True)
    first = llm.generate(reqs[:1], GREEDY, use_tqdm=False)
    warm = llm.generate(reqs, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert first[0].token_ids == cold[0].token_ids
    assert all(o.cached_tokens >= 192 for o in warm)
    assert llm.stats().prefix_cache_hit_rate > 0


def test_fully_cached_prompt_recomputes_its_last_block(llm, fresh):
    """A prompt of exactly four blocks, seen before: everything but the last block is served from
    the cache and the answer is unchanged (nano-vllm crashed on this case, #114/#144)."""
    fresh()
    ids = llm.tokenizer.encode(LONG)[:64]
    assert len(ids) == 4 * llm.engine.config.block_size
    cold = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    warm = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert warm.cached_tokens == 48
    assert warm.token_ids == cold.token_ids


def test_preemption_does_not_change_greedy_tokens(llm, fresh, prompts):
    ids = [llm.tokenizer.encode(p) for p in ("Once upon a time", "The weather today", "def add(a, b):")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    fresh()
    alone = [llm.generate([i], params, use_tqdm=False)[0].token_ids for i in ids]
    fresh(num_kv_blocks=9)  # block_size 16: 144 slots for 3 x ~60 tokens: someone must yield
    squeezed = llm.generate(ids, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert [o.token_ids for o in squeezed] == alone
    assert llm.stats().kv_blocks_free == 9


def test_chunked_prefill_does_not_change_greedy_tokens(llm, fresh, prompts):
    ids = [llm.tokenizer.encode(LONG), llm.tokenizer.encode(CODE)]
    fresh()
    whole = llm.generate(ids, GREEDY, use_tqdm=False)
    fresh(max_num_batched_tokens=24, max_num_seqs=8)
    chunked = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_batch_of_16_matches_each_alone(llm, fresh):
    texts = [f"Item {i}: a short story about the number {i * 7}." for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fresh()
    batched = llm.generate(texts, params, use_tqdm=False)
    for i in (0, 5, 15):
        alone = llm.generate([texts[i]], params, use_tqdm=False)[0]
        assert alone.token_ids == batched[i].token_ids


def test_all_blocks_free_after_finish_and_abort(llm, fresh):
    fresh()
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"a{i}", f"Count to {i + 3}:", SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort("a1") and eng.abort("a3")
    assert not eng.abort("a1")
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {
        "a0": FinishReason.LENGTH,
        "a1": FinishReason.ABORT,
        "a2": FinishReason.LENGTH,
        "a3": FinishReason.ABORT,
    }
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_integrity()


def test_stop_string_cuts_text_and_finishes(llm, fresh):
    fresh()
    base = llm.generate(["The alphabet: A, B, C,"], GREEDY, use_tqdm=False)[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
    out = llm.generate(["The alphabet: A, B, C,"], params, use_tqdm=False)[0]
    assert out.finish_reason == FinishReason.STOP_STRING
    assert out.text == base.text[: base.text.index(stop)]


def test_stop_string_completed_by_the_last_allowed_token_reports_stop_string(llm, fresh):
    fresh()
    prompt = "The alphabet: A, B, C,"
    first = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 8)]
    before, whole = (llm.generate([prompt], p, use_tqdm=False)[0].text for p in first)
    assert whole.startswith(before) and len(whole) > len(before)
    # the shortest tail of the text that the 8th token completes and that occurs nowhere earlier
    k = next(k for k in range(1, len(whole) + 1) if whole.find(whole[-k:]) == len(whole) - k)
    stop = whole[-max(k, len(whole) - len(before)):]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 8
    assert out.finish_reason == FinishReason.STOP_STRING
    assert out.text == whole[: len(whole) - len(stop)]


def test_tiny_temperature_is_greedy_and_tiny_penalties_are_refused(llm, fresh):
    fresh()
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    tiny = llm.generate(["Hello"], SamplingParams(temperature=1e-38, max_tokens=8), use_tqdm=False)[0]
    assert tiny.token_ids == greedy.token_ids
    for bad in (1e-38, 1e38):
        with pytest.raises(ValueError, match="repetition_penalty"):
            llm.engine.add_request("bad", "Hello", SamplingParams(repetition_penalty=bad))
    with pytest.raises(ValueError, match="temperature"):
        llm.engine.add_request("bad", "Hello", SamplingParams(temperature=1e300))


def test_prefix_cache_hit_rate_ignores_recomputation_after_preemption(llm, fresh):
    ids = [llm.tokenizer.encode(p) for p in ("Once upon a time", "The weather today", "def add(a, b):")]
    fresh(num_kv_blocks=9)  # as in the preemption test: someone must yield and be recomputed
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate == 0.0  # no two prompts share a block


def test_seeded_sampling_is_reproducible_in_any_batch(llm, fresh):
    fresh()
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Tell me a story"], p, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(["x y z", "Tell me a story", "Hello"], [others, p, others], use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids


def test_bad_requests_are_refused_with_field_names(llm):
    eng = llm.engine
    cases = [
        ("", SamplingParams(), "prompt"),
        ([eng.vocab_size + 5], SamplingParams(), "token_ids"),
        ("hi", SamplingParams(temperature=float("nan")), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
        ("hi", SamplingParams(max_tokens=10**6), "max_model_len"),
    ]
    for prompt, params, word in cases:
        with pytest.raises(ValueError, match=word):
            eng.add_request("bad", prompt, params)
    assert not eng.has_unfinished_requests()


def test_token_budget_below_max_num_seqs_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)


def test_unknown_engine_option_is_an_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("default", max_num_seq=4)


# ---- a step that raises loses nothing: the abort outputs taken for that step come out of the
# next one (defect: they were dropped, and whoever waited for them waited forever) ----------------

@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    path = write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, max_model_len=128))
    yield eng
    eng.shutdown()


def test_abort_outputs_survive_a_step_that_raises(tiny_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tiny_engine.add_request("a", [1, 2, 3], params)
    tiny_engine.add_request("b", [4, 5, 6], params)
    tiny_engine.step()
    assert tiny_engine.abort("a")

    def broken(inp):
        raise RuntimeError("injected device error")

    monkeypatch.setattr(tiny_engine.executor, "execute_model", broken)
    with pytest.raises(RuntimeError, match="injected"):
        tiny_engine.step()
    monkeypatch.undo()
    outputs = {o.request_id: o for o in tiny_engine.step()}
    assert outputs["a"].finished and outputs["a"].finish_reason == FinishReason.ABORT
    assert not outputs["b"].finished and outputs["b"].new_token_ids
    tiny_engine.abort("b")
    tiny_engine.step()
    assert not tiny_engine.has_unfinished_requests()
    assert tiny_engine.block_manager.num_free_blocks == tiny_engine.block_manager.num_blocks
