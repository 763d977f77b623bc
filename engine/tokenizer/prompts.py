"""Prompts -> token ids: text prompts, token-id prompts and chat messages (rendered with the
model's chat template), with the checks that come before any tokenizer work.

One ``PromptEncoder`` serves the in-process engine (``LLMEngine.add_request``) and the
service's front-end, which runs it on a thread pool so that tokenizing a long prompt never
stalls the event loop or the engine core. A prompt that cannot fit ``max_model_len`` whatever
it tokenizes to is refused by its character count before the tokenizer sees it: no token of
this vocabulary covers more than ``max_token_chars`` characters, so a longer text would need
more than ``max_model_len`` tokens.
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

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text or token ids -> checked token ids; raises ValueError naming the field."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            self._check_chars("prompt", len(prompt))
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("token_ids: must not be empty")
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token_ids: id {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages -> the chat template's token ids. Any error of the template (jinja
        raises its own exception types) is the request's fault: a ValueError for that request."""
        if not messages:
            raise ValueError("messages: must not be empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                role = str(m.get("role"))[:64]  # a client's string: never echoed whole
                raise ValueError(f"messages[{i}].role: {role!r} is not one of {list(CHAT_ROLES)}")
        self._check_chars("messages", sum(len(m.get("content") or "") for m in messages))
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja2.TemplateError and whatever a template raises
            raise ValueError(f"messages: the model's chat template failed: {type(e).__name__}: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone with special tokens kept (what logprobs show beside
        the id). Remembered: the alternatives of one request repeat the same ids often."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _check_chars(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {chars} characters cannot fit max_model_len ({self.max_model_len} tokens of at "
                f"most {self.max_token_chars} characters each = {self.max_prompt_chars} characters)"
            )
