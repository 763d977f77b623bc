"""Speculation on a GGUF K-quant model, end to end (issue 48): a random-weight llama file in
llama-quantize's Q4_K_M types (Q4_K projections, Q6_K v/down and tied table) with a small byte-level
BPE tokenizer, served through ``LLM`` in bfloat16, where the projections run in the int8 block dots
and the int8 GEMM (float32 takes dequantized panels). Greedy tokens with n-gram drafts on equal those
with them off (and log-probabilities), each prompt alone and all at once, on every CPU class
``make test-isa`` builds: verification rows are the rows plain decoding computes, which holds as far
as the engine's ``exact_rows`` says (``GGUFWeight.alike_rows``: at any count where every part's GEMM
rows are the dots' bits, the AVX512-VNNI K-quants, whose verification steps of 16 rows or more take
the GEMM where plain decoding takes the dots; below ``PANEL_FROM_ROWS`` otherwise, AVX2). One prompt
is longer than the token budget, so its prefill runs in chunks beside the others' decode rows. All
at once, both arms run all at once: no step with a prefill chunk carries drafts, so both arms chunk
that prompt alike, and a chunk's attention tiling (docs/serving/speculative.md) and the decode rows
beside a chunk of ``PANEL_FROM_ROWS`` or more (the GEMM: not the dots' bits on AVX2) are the same in
both; against each prompt alone they may differ in the last bit, speculation or not."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve.benchmarks.scale.prefill import write_model
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.gguf_linear import GEMM_FROM_ROWS, PANEL_FROM_ROWS
from kvserve.engine.spec_decode.policy import StepCosts
from kvserve.kernels.cpu.kquant import kquant_kernels
from kvserve.testing.engine import with_control_plane

pytestmark = pytest.mark.skipif(kquant_kernels() is None or kquant_kernels().isa == 0,
                                reason="the vector block kernels are not built here")

VOCAB = 512
LETTERS = "etaoinsrhl dcumfpgwybvk"
PROMPTS = [
    "the three tests, the three tests, the three tests, the",
    "a b c d, a b c d, a b c d, a b c d, a b",
    "no more rows here",
    "red green blue, red green blue, red green",
    "to be or not to be, to be or not",
    # longer than PANEL_FROM_ROWS tokens: its prefill chunk takes the int8 GEMM
    "one two three four five six seven eight nine ten " * 11,
]
# drafting is nearly free up to 64 rows, whatever a busy machine measured at start-up: batched
# verification steps then reach GEMM_FROM_ROWS rows (AVX512-VNNI: the GEMM, where a plain step of
# one row per sequence takes the dots)
CHEAP_ROWS = StepCosts({1: 1.0, 64: 1.05})
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


def tokenizer_fields() -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level BPE of ``VOCAB`` tokens: the 256 bytes, merges of letter pairs, and
    an end-of-text token (last)."""
    spell = bytes_to_unicode()
    tokens, merges = [spell[b] for b in range(256)], []
    for a in LETTERS:
        for b in LETTERS:
            if len(tokens) < VOCAB - 1:
                a_, b_ = spell[ord(a)], spell[ord(b)]
                merges.append(f"{a_} {b_}")
                tokens.append(a_ + b_)
    return tokens + ["<|endoftext|>"], merges


@pytest.fixture(scope="module")
def llm(tmp_path_factory, monkeypatch_module):
    tokens, merges = tokenizer_fields()
    header = GGUFWriter.write_header_to_file

    def with_tokenizer(writer, *args, **kwargs):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (VOCAB - 1) + [3])
        writer.add_token_merges(merges)
        writer.add_eos_token_id(VOCAB - 1)
        writer.add_add_bos_token(False)
        return header(writer, *args, **kwargs)

    path = tmp_path_factory.mktemp("gguf") / "model-Q4_K_M.gguf"
    monkeypatch_module.setattr(GGUFWriter, "write_header_to_file", with_tokenizer)
    write_model(path, 2, 1024, hidden=1024, inter=2048, heads=8, kv_heads=4, vocab=VOCAB)
    monkeypatch_module.undo()
    # one thread: the rows' bits do not depend on the thread count, and one does not wait on a busy machine
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=192, threads=1)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def tokens(llm: LLM, prompts: list[str], together: bool) -> list[tuple[list[int], list]]:
    """Each prompt's tokens and log-probabilities (the logits' bits, as far as two top entries show)."""
    outs = (llm.generate(prompts, PARAMS, use_tqdm=False) if together
            else [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts])
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_ngram_speculation_gives_plain_greedy_tokens_on_a_k_quant_model(llm, together):
    assert len(llm.tokenizer.encode(PROMPTS[-1])) > PANEL_FROM_ROWS
    formats = dict(f.split("=") for f in llm.engine.executor.weight_formats)
    x16 = "_X16" if kquant_kernels().isa == 512 else ""  # repacked where the kernels run them
    assert formats["qkv_proj"] == f"Q4_K{x16},Q6_K{x16}" and formats["down_proj"] == f"Q6_K{x16}", formats
    with_control_plane(llm, speculative="off")
    plain = tokens(llm, PROMPTS, together)
    with_control_plane(llm, CHEAP_ROWS, speculative="ngram", num_speculative_tokens=8,
                       prompt_lookup_min=1)
    verified: list[int] = []  # the rows of each step that verified drafts
    runs = llm.engine.speculator.runs

    def counted(scheduled, row_tokens):
        if any(s.drafts for s in scheduled):
            verified.append(len(row_tokens))
        return runs(scheduled, row_tokens)

    llm.engine.speculator.runs = counted
    spec = tokens(llm, PROMPTS, together)
    stats = llm.stats()
    assert spec == plain
    if together:
        assert max(verified) >= GEMM_FROM_ROWS, verified
    # drafts were verified, some kept and some refused: both verification outcomes were exercised
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.kv_blocks_free == stats.kv_blocks_total
