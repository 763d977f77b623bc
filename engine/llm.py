"""``LLM``: the offline, in-process API (``LLM(model).generate(prompts, params)``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.ipc import EngineStats
from kvserve.engine.core.llm_engine import LLMEngine
from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "default", **config):
        # No step-time bound unless asked for: the bound keeps a server's streams' token gaps short,
        # and generate() returns whole outputs (docs/performance/tuning.md has the figures)
        config.setdefault("max_step_time_ms", 0)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; results come back in input order (with ``n`` > 1,
        each result is choice 0 and its ``choices`` hold all n). A structured-output constraint
        that does not compile raises ValueError naming its field."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        order: dict[str, int] = {}
        results: dict[str, CompletionOutput] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, p, sp)
                order[rid] = i
                prompt_ids = self.engine.requests[rid].seq.prompt_token_ids
                results[rid] = _empty_result(rid, prompt_ids, sp.n)
            self._run(results, use_tqdm)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            self.engine.step()  # drain the abort outputs
            raise
        return sorted(results.values(), key=lambda r: order[r.request_id])

    def _run(self, results: dict[str, CompletionOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        unfinished = {rid: len(r.choices) or 1 for rid, r in results.items()}
        done = 0
        while done < len(results):
            outputs = self.engine.step()
            for _, error in self.engine.take_rejected():
                raise error
            for out in outputs:
                r = results[out.request_id]
                r = r.choices[out.index] if r.choices else r
                r.token_ids.extend(out.new_token_ids)
                r.text += out.new_text
                r.logprobs.extend(out.new_logprobs)
                if out.finished:
                    r.finish_reason = out.finish_reason
                    r.cached_tokens = out.cached_tokens
                    r.draft_tokens, r.accepted_draft_tokens = out.draft_tokens, out.accepted_draft_tokens
                    r.times = out.times
                    unfinished[out.request_id] -= 1
                    if not unfinished[out.request_id]:
                        done += 1
                        bar.update(1)
            eng = self.engine
            bar.set_postfix(running=eng.num_running(), waiting=eng.num_waiting(), refresh=False)
        bar.close()

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None, **kw):
        ids = self.engine.apply_chat_template(messages)
        return self.generate([ids], sampling_params, **kw)[0]

    def stats(self) -> EngineStats:
        """The engine's state and counters (the fields of the server's Stats the engine knows)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _empty_result(request_id: str, prompt_ids: list[int], n: int) -> CompletionOutput:
    first = CompletionOutput(request_id, prompt_ids, "", [], None, [])
    if n > 1:
        first.choices = [first] + [CompletionOutput(request_id, prompt_ids, "", [], None, [], index=i)
                                   for i in range(1, n)]
    return first
