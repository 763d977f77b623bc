"""Structured output and n completions per prompt, in process, on the default model (float32).

Every constrained completion that ends with STOP parses and validates (jsonschema, regex,
choice list, grammar), greedy and sampled, also when preemption recomputes sequences; a
constraint that does not compile is refused naming its field; ``n`` choices fork from one
prefill (their prompt blocks are shared by reference count, prefix caching off) and choice i
samples with seed + i.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.constraints import MAX_N, Constraint
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sequence import FinishReason
from kvserve.engine.structured.grammar import GrammarCompiler, choice_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "color": {"enum": ["red", "green", "yellow"]},
        "sizes": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "minItems": 1, "maxItems": 2},
            "minItems": 1, "maxItems": 2,
        },
    },
    "required": ["name", "color", "sizes"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"


@pytest.fixture(scope="module")
def llm():
    llm = LLM("default", dtype="float32", max_num_seqs=16, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def chat(llm: LLM, text: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": text}])


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.requests and not llm.engine.structured._matchers


def test_json_schema_outputs_parse_and_validate_greedy_and_sampled(llm):
    prompt = chat(llm, "Describe a fruit as JSON: its name, color and sizes.")
    params = [SamplingParams(temperature=0.0, max_tokens=64, json_schema=json.dumps(SCHEMA))]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=64, json_schema=json.dumps(SCHEMA))
               for s in (1, 2, 3)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # the sampled rows really sampled
    assert_all_blocks_free(llm)


def test_regex_choice_grammar_and_json_object(llm):
    prompt = chat(llm, "Give me one example.")
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=16, regex=DATE), lambda t: re.fullmatch(DATE, t)),
        (SamplingParams(temperature=0.9, seed=4, max_tokens=24, regex=EMAIL),
         lambda t: re.fullmatch(EMAIL, t)),
        (SamplingParams(temperature=0.9, seed=5, max_tokens=8, choice=["apple", "banana split", 'say "hi"']),
         lambda t: t in ("apple", "banana split", 'say "hi"')),
        (SamplingParams(temperature=0.0, max_tokens=8, grammar='root ::= ("yes" | "no") "!"'),
         lambda t: t in ("yes!", "no!")),
    ]
    outs = llm.generate([prompt] * len(cases), [p for p, _ in cases], use_tqdm=False)
    for out, (_, ok) in zip(outs, cases, strict=True):
        assert out.finish_reason == FinishReason.STOP and ok(out.text), out.text
    assert_all_blocks_free(llm)


def test_json_object_output_is_json_or_a_prefix_of_it(llm):
    """Free-form JSON may outgrow max_tokens: then the text must still be a viable prefix."""
    out = llm.generate(chat(llm, "Describe a fruit as JSON."),
                       SamplingParams(temperature=0.0, max_tokens=32, json_object=True), use_tqdm=False)[0]
    if out.finish_reason == FinishReason.STOP:
        assert isinstance(json.loads(out.text), dict), out.text
    else:
        assert out.finish_reason == FinishReason.LENGTH and out.text.startswith("{")
        matcher = xgr.GrammarMatcher(llm.engine.structured.compile(Constraint("json_object", "")))
        assert matcher.accept_string(out.text), out.text
    assert_all_blocks_free(llm)


def test_constraint_with_logprobs_stop_string_and_length(llm):
    prompt = chat(llm, "Describe a fruit as JSON.")
    schema = json.dumps(SCHEMA)
    logprobs, short = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0.0, max_tokens=64, json_schema=schema, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=3, json_schema=schema),
    ], use_tqdm=False)
    assert len(logprobs.logprobs) == len(logprobs.token_ids)
    assert all(lp.top[0][1] >= lp.logprob for lp in logprobs.logprobs)
    assert short.finish_reason == FinishReason.LENGTH and logprobs.text.startswith(short.text)
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64, json_schema=schema,
                                              stop=['"color"']), use_tqdm=False)[0]
    assert cut.finish_reason == FinishReason.STOP_STRING and logprobs.text.startswith(cut.text)


@pytest.mark.parametrize(("params", "field"), [
    (dict(regex="[a-"), "regex: does not compile"),
    (dict(json_schema="{not json"), "json_schema: does not compile"),
    (dict(grammar="root ::= missing"), "grammar: does not compile"),
    (dict(regex="a", choice=["a"]), "regex, choice"),
    (dict(choice=["a", ""]), "choice"),
    (dict(regex="a", ignore_eos=True), "ignore_eos"),
    (dict(n=MAX_N + 1), "n must be in [1, 16]"),
    (dict(n=0), "n must be in"),
])
def test_bad_constraint_or_n_is_refused_naming_the_field(llm, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("Hello", SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_compiled_grammars_are_cached_by_text(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids)
    try:
        first = compiler.compile(Constraint("regex", DATE))
        assert compiler.compile(Constraint("regex", DATE)) is first
        assert compiler.compile(Constraint("regex", EMAIL)) is not first
    finally:
        compiler.shutdown()  # its compile processes
    assert choice_grammar(("a\\b", 'q"', "x\ny")) == 'root ::= "a\\\\b" | "q\\"" | "x\\ny"'


def test_n_choices_fork_from_one_prefill_with_own_seeds(llm):
    bs = llm.engine.config.block_size
    prompt = chat(llm, "Write one short sentence about the sea, the wind and the boats in the harbour.")
    shared = (len(prompt) - 1) // bs * bs
    assert shared >= bs
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=8, n=4), use_tqdm=False)[0]
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.choices[0] is out
    assert len({tuple(c.token_ids) for c in out.choices}) == 4
    # prefix caching is off: the other choices' prompt blocks came from choice 0 by reference
    assert [c.cached_tokens for c in out.choices] == [0] + [shared] * 3
    alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=9, max_tokens=8), use_tqdm=False)[0]
    assert alone.token_ids == out.choices[2].token_ids  # choice i samples with seed + i
    assert_all_blocks_free(llm)


def test_n_with_a_constraint_under_preemption(llm):
    """A KV cache too small for three of the four choices at once forces preemption: recomputed sequences
    keep their matcher state and the forked choices their shared blocks; every output holds."""
    eng, bs = llm.engine, llm.engine.config.block_size
    question = "What day is it? Tell me the date of today, please, in the usual form with year month and day."
    prompts = (chat(llm, question[:end]) for end in range(15, len(question) + 1))
    # the prompt's last block has one free slot: every choice needs a second block of its own
    prompt = next(p for p in prompts if len(p) % bs == bs - 1)
    shared = (len(prompt) - 1) // bs
    blocks = shared + 5  # choice 0 and two forks need 6 as soon as they have two tokens
    saved = eng.block_manager, eng.scheduler
    eng.block_manager = BlockManager(blocks, bs, enable_prefix_caching=True)
    eng.scheduler = Scheduler(eng.block_manager, 16, eng.config.max_num_batched_tokens,
                              eng.config.max_model_len, eng.eos_token_ids)
    try:
        out = llm.generate(prompt,
                           SamplingParams(temperature=1.0, seed=11, max_tokens=16, regex=DATE, n=4),
                           use_tqdm=False)[0]
        assert eng.scheduler.num_preemptions > 0
        for c in out.choices:
            assert c.finish_reason == FinishReason.STOP and re.fullmatch(DATE, c.text), c.text
        assert_all_blocks_free(llm)
    finally:
        eng.block_manager, eng.scheduler = saved


def test_abort_of_a_request_with_forks_and_compiles_pending(llm):
    eng = llm.engine
    eng.add_request("a", "The sea is", SamplingParams(max_tokens=8, n=3))
    eng.add_request("b", "The sea is", SamplingParams(max_tokens=8, regex="[a-z ]+"))
    assert eng.abort("a") and eng.abort("b")
    outs = eng.step()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outs) == [
        ("a", 0, FinishReason.ABORT), ("a", 1, FinishReason.ABORT), ("a", 2, FinishReason.ABORT),
        ("b", 0, FinishReason.ABORT)]
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_constraints_under_tensor_parallelism_give_the_single_process_outputs(llm):
    """Rank 0 masks and samples; the workers only run the model: TP=3 gives TP=1's outputs."""
    prompt = chat(llm, "Describe a fruit as JSON.")
    params = [SamplingParams(temperature=0.0, max_tokens=48, json_schema=json.dumps(SCHEMA)),
              SamplingParams(temperature=0.9, seed=4, max_tokens=24, regex=EMAIL),
              SamplingParams(temperature=0.0, max_tokens=8, choice=["apple", "banana split"], n=2)]
    want = llm.generate([prompt] * 3, params, use_tqdm=False)
    tp = LLM("default", dtype="float32", max_num_seqs=16, enable_prefix_caching=False, tensor_parallel_size=3)
    try:
        got = tp.generate([prompt] * 3, params, use_tqdm=False)
    finally:
        tp.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[c.text for c in o.choices] for o in got] == [[c.text for c in o.choices] for o in want]
    assert re.fullmatch(EMAIL, got[1].text) or got[1].finish_reason == FinishReason.LENGTH
