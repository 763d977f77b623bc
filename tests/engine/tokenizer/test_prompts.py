"""The checks a prompt passes before any model work (engine/tokenizer/prompts.py), on the bundled
model's tokenizer and chat template: chat messages bounded by their count and rendered length
before the template runs, prompts of max_model_len tokens or more refused, ids the model's
vocabulary does not have refused."""

from __future__ import annotations

import pytest

from kvserve.engine.tokenizer.prompts import PromptEncoder

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(default_source):
    from kvserve.engine.tokenizer.load import load_tokenizer

    return load_tokenizer(default_source)


def test_the_chat_templates_overhead_per_message_is_measured(tokenizer):
    enc = PromptEncoder(tokenizer, VOCAB, 8192)
    # SmolLM2: "<|im_start|>user\n<|im_end|>\n" around an empty message
    assert enc.message_chars == len("<|im_start|>user\n<|im_end|>\n")
    assert enc.message_tokens == 5
    assert enc.max_messages == 8192 // 5
    turns = [{"role": "user", "content": ""}] * 3
    assert len(enc.render_chat(turns)) < len(enc.render_chat(turns * 2))


def test_very_many_messages_are_refused_by_their_count_before_rendering(tokenizer):
    enc = PromptEncoder(tokenizer, VOCAB, 8192)
    with pytest.raises(ValueError, match=r"messages: 500000 messages cannot fit max_model_len \(8192 tokens; "
                                         r"the chat template adds at least 5 per message = at most 1638"):
        enc.render_chat([{"role": "user", "content": ""}] * 500_000)


def test_the_rendered_length_counts_the_template_around_each_message(tokenizer):
    enc = PromptEncoder(tokenizer, VOCAB, 256)
    per_message = enc.max_prompt_chars // enc.max_messages - enc.message_chars + 1
    turns = [{"role": "user", "content": "x" * per_message}] * enc.max_messages
    assert sum(len(t["content"]) for t in turns) <= enc.max_prompt_chars  # the content alone would pass
    with pytest.raises(ValueError, match=r"messages \(rendered\): \d+ characters cannot fit max_model_len"):
        enc.render_chat(turns)


def test_a_prompt_of_max_model_len_tokens_is_refused_before_the_engine(tokenizer):
    enc = PromptEncoder(tokenizer, VOCAB, 64)
    with pytest.raises(ValueError, match=r"prompt: \d+ tokens leave no room .* max_model_len \(64"):
        enc.encode("word " * 100)
    with pytest.raises(ValueError, match=r"token_ids: 64 tokens leave no room"):
        enc.encode(list(range(64)))
    with pytest.raises(ValueError, match=r"messages: \d+ tokens leave no room"):
        enc.render_chat([{"role": "user", "content": "word " * 60}])
    assert enc.encode(list(range(63))) == list(range(63))


def test_ids_the_model_does_not_have_are_refused_even_when_the_tokenizer_makes_them(tokenizer):
    enc = PromptEncoder(tokenizer, 512, 256)  # a model with fewer rows than the tokenizer has ids
    with pytest.raises(ValueError, match=r"prompt: id \d+ is outside the vocabulary \[0, 512\)"):
        enc.encode("The capital of France is")
    with pytest.raises(ValueError, match=r"token_ids: id 512 is outside the vocabulary"):
        enc.encode([1, 512])
    # Tokenize's ids are the tokenizer's, whatever the model: only a request is held to them
    assert max(enc.encode("The capital of France is", generate=False)) >= 512
    assert max(enc.render_chat([{"role": "user", "content": "Hi"}], generate=False)) >= 512


def test_a_tokenizer_without_a_chat_template_bounds_messages_by_max_model_len(tokenizer):
    from copy import copy

    plain = copy(tokenizer)
    plain.chat_template = None
    enc = PromptEncoder(plain, VOCAB, 100)
    assert (enc.message_chars, enc.message_tokens, enc.max_messages) == (0, 0, 100)
