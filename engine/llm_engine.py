"""The engine loop: requests in, per-step token/text deltas out.

``LLMEngine`` owns the scheduler, block manager, model runner (or tensor-parallel executor),
sampler and detokenizers. It is not thread-safe: one thread drives it (``LLM.generate`` in
process, the service's engine thread under gRPC). ``add_request`` validates at the door;
``step`` runs one scheduler + model step; ``abort`` ends a request in any state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvserve.engine.block_manager import BlockManager
from kvserve.engine.config import EngineConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.executor import create_executor
from kvserve.engine.layers.sampler import Sampler
from kvserve.engine.loader import load_generation_eos, load_hf_config, load_tokenizer, resolve_model
from kvserve.engine.model_input import build_model_input
from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.prompts import PromptEncoder
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import FinishReason, Sequence

log = logging.getLogger("kvserve.engine")

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    reported: bool = False  # the final output has been handed out


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.source = resolve_model(config.model)
        hf_config = load_hf_config(self.source)
        config = config.replace(max_model_len=resolve_max_model_len(config, hf_config))
        self.config = config
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = load_generation_eos(self.source, hf_config, self.tokenizer)
        self.executor = create_executor(config)
        self.vocab_size = self.executor.vocab_size
        self.model_name = self.source.name
        self.architecture = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
        self.block_manager = BlockManager(
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            self.eos_token_ids,
        )
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed)
        self.prompts = PromptEncoder(self.tokenizer, self.vocab_size, config.max_model_len)
        self.requests: dict[str, _Request] = {}
        self._aborted: list[RequestOutput] = []
        self.started = time.monotonic()
        self.counters = dict.fromkeys(
            ("requests_finished", "requests_aborted", "prompt_tokens_total", "generation_tokens_total"), 0
        )

    # ---- requests in ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.prompts.encode(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.prompts.render_chat(messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises ValueError naming the field and the limit."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params.validate(self.vocab_size)
        ids = self.encode_prompt(prompt)
        seq = Sequence(request_id, ids, params)
        self.scheduler.add(seq)  # raises when it could never fit
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop)
        self.requests[request_id] = _Request(seq, detok)
        self.counters["prompt_tokens_total"] += len(ids)

    def abort(self, request_id: str) -> bool:
        """End a request in any state; its blocks return to the pool now, its final output
        (finish_reason ABORT) comes out of the next ``step``."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        self.counters["requests_aborted"] += 1
        self._aborted.append(self._output(req, [], "", [], tail=""))
        return True

    # ---- the loop -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted)

    def step(self) -> list[RequestOutput]:
        """One scheduler + model step; returns every request's delta of this step (the outputs
        of aborted requests included). If the step raises, the abort outputs are kept for the
        next call, so no request's final output is lost."""
        aborted, self._aborted = self._aborted, []
        try:
            return aborted + self._step()
        except BaseException:
            self._aborted = aborted + self._aborted
            raise

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        inp = build_model_input(sched.scheduled, self.config.block_size)
        logits = self.executor.execute_model(inp)
        sampling = sched.sampling_seqs
        sampled = self.sampler(logits, sampling)
        self.scheduler.postprocess(sched, sampled.token_ids)
        self.counters["generation_tokens_total"] += len(sampling)
        for seq, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            outputs.append(self._emit(self.requests[seq.request_id], token, lp))
        return outputs

    def _emit(self, req: _Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq = req.seq
        # the EOS / stop token that ended the request is reported as a token, not as text
        ended_by_token = seq.finish_reason == FinishReason.STOP
        text = "" if ended_by_token else req.detok.add(token)
        if req.detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP_STRING)
        tail = req.detok.finish() if seq.is_finished and not req.detok.stopped else ""
        if seq.is_finished:
            del self.requests[seq.request_id]
            self.counters["requests_finished"] += 1
        return self._output(req, [token], text, [logprobs] if logprobs else [], tail)

    def _output(self, req: _Request, tokens, text: str, logprobs, tail: str) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text + tail,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            cached_tokens=seq.num_cached_prompt_tokens or 0,
            times=seq.times,
        )

    # ---- state ----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def is_healthy(self) -> bool:
        return self.executor.is_healthy()

    def stats(self) -> dict:
        ex = self.executor
        return {
            "model": self.model_name,
            "device": str(ex.device),
            "dtype": str(ex.dtype).removeprefix("torch."),
            "tp_size": self.config.tensor_parallel_size,
            "attention_backend": ex.attention_backend_name,
            "num_waiting": self.num_waiting(),
            "num_running": self.num_running(),
            "num_queued": 0,
            "max_queue": 0,
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "kv_block_size": self.config.block_size,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "prefix_cache_queries": self.block_manager.query_tokens,  # prompt tokens looked up
            "prefix_cache_hits": self.block_manager.hit_tokens,  # of which found
            "num_preemptions": self.scheduler.num_preemptions,
            **self.counters,
            "requests_rejected": 0,
            "uptime_s": time.monotonic() - self.started,
        }

    def model_info(self) -> dict:
        """Facts about the loaded model (the ModelInfo RPC's fields the engine knows)."""
        return {
            "model": self.model_name,
            "architecture": self.architecture,
            "max_model_len": self.config.max_model_len,
            "vocab_size": self.vocab_size,
            "dtype": str(self.executor.dtype).removeprefix("torch."),
            "tp_size": self.config.tensor_parallel_size,
            "eos_token_ids": list(self.eos_token_ids),
            "kv_block_size": self.config.block_size,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if config.max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's limit ({limit})")
    return config.max_model_len
