"""Prompts -> token ids: text prompts, token-id prompts and chat messages (rendered with the
model's chat template), with the checks that come before any tokenizer work.

One ``PromptEncoder`` serves the in-process engine (``LLMEngine.add_request``) and the
service's front-end, which runs it on a thread pool so that tokenizing a long prompt never
stalls the event loop or the engine core. A prompt that cannot fit ``max_model_len`` whatever
it tokenizes to is refused by its character count before the tokenizer sees it: no token of
this vocabulary covers more than ``max_token_chars`` characters, so a longer text would need
more than ``max_model_len`` tokens.

Chat messages are bounded before the template renders them, too: the template adds text and
tokens around every message (measured once, from renderings of one, two and three empty
messages), so 500,000 empty messages (4 MB) that once took 21 s of CPU and 2.75 GiB to
render are refused by their count, and their rendered length is estimated as the content's
characters plus that overhead per message. A prompt that tokenizes to ``max_model_len`` tokens
or more can never run, and is refused here rather than shipped to the engine core.
"""

from __future__ import annotations

CHAT_ROLES = ("system", "user", "assistant", "tool")
MIN_CHARS_PER_TOKEN = 16  # floor for tokenizers whose vocabulary holds only short entries


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
        self.max_token_chars = max(longest, MIN_CHARS_PER_TOKEN)
        self.max_prompt_chars = max_model_len * self.max_token_chars
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary id
        self.message_chars, self.message_tokens = self._message_overhead()
        # every message adds at least one token (a template that adds none to an empty message
        # still renders the message's content, and a message is no use without any)
        self.max_messages = max_model_len // max(1, self.message_tokens)

    def encode(self, prompt: str | list[int], generate: bool = True) -> list[int]:
        """Text or token ids -> checked token ids; raises ValueError naming the field. With
        ``generate`` False (Tokenize: the ids, not a request) a text's ids are not held to
        max_model_len and the model's vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            self._check_chars("prompt", len(prompt))
            ids = self.tokenizer.encode(prompt)
            return self.check_tokens("prompt", ids) if generate else ids
        ids = list(prompt)
        if not ids:
            raise ValueError("token_ids: must not be empty")
        return self.check_tokens("token_ids", ids)

    def render_chat(self, messages: list[dict[str, str]], generate: bool = True) -> list[int]:
        """Chat messages -> the chat template's token ids (``generate`` as in ``encode``; the bounds
        before rendering hold either way). Any error of the template (jinja raises its own
        exception types) is the request's fault: a ValueError for that request."""
        if not messages:
            raise ValueError("messages: must not be empty")
        if len(messages) > self.max_messages:
            raise ValueError(
                f"messages: {len(messages)} messages cannot fit max_model_len ({self.max_model_len} tokens; "
                f"the chat template adds at least {max(1, self.message_tokens)} per message = at most "
                f"{self.max_messages} messages)")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                role = str(m.get("role"))[:64]  # a client's string: never echoed whole
                raise ValueError(f"messages[{i}].role: {role!r} is not one of {list(CHAT_ROLES)}")
        content = sum(len(m.get("content") or "") for m in messages)
        self._check_chars("messages (rendered)", content + len(messages) * self.message_chars)
        ids = self.tokenizer.encode(self._render(messages), add_special_tokens=False)
        return self.check_tokens("messages", ids) if generate else ids

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja2.TemplateError and whatever a template raises
            raise ValueError(f"messages: the model's chat template failed: {type(e).__name__}: {e}") from e

    def _message_overhead(self) -> tuple[int, int]:
        """(characters, tokens) the chat template adds around one empty message at the least:
        the smaller growth from one to two and from two to three messages (a user's and an
        assistant's). (0, 0) when there is no template or it refuses these renderings."""
        if not getattr(self.tokenizer, "chat_template", None):
            return 0, 0
        turns = [{"role": role, "content": ""} for role in ("user", "assistant", "user")]
        try:
            texts = [self._render(turns[:k]) for k in (1, 2, 3)]
        except ValueError:
            return 0, 0
        tokens = [len(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        chars = min(len(texts[1]) - len(texts[0]), len(texts[2]) - len(texts[1]))
        return max(0, chars), max(0, min(tokens[1] - tokens[0], tokens[2] - tokens[1]))

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone with special tokens kept (what logprobs show beside
        the id). Remembered: the alternatives of one request repeat the same ids often."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def check_tokens(self, field: str, ids: list[int]) -> list[int]:
        """A prompt's ids, checked: shorter than max_model_len, every id in the model's vocabulary
        (a tokenizer can know more ids than the model's embedding has rows)."""
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{field}: {len(ids)} tokens leave no room for a completion: a prompt must be "
                             f"shorter than max_model_len ({self.max_model_len} tokens)")
        for t in (min(ids, default=0), max(ids, default=0)):  # one pass each in C, not a loop per id
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: id {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_chars(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {chars} characters cannot fit max_model_len ({self.max_model_len} tokens of at "
                f"most {self.max_token_chars} characters each = {self.max_prompt_chars} characters)"
            )
