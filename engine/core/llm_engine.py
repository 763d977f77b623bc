"""The engine loop: requests in, per-step token/text deltas out.

``LLMEngine`` owns the scheduler, block manager, model runner (or tensor-parallel executor),
sampler and detokenizers. It is not thread-safe: one thread drives it (``LLM.generate`` in
process; under gRPC, the engine-core process's loop, ``core/core_process.py``). ``add_request``
validates at the door; ``step`` runs one scheduler + model step; ``abort`` ends a request in any
state.
"""

from __future__ import annotations

import functools
import logging
import time

from kvserve.engine.config import (
    EngineConfig,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
    resolve_max_step_time,
)
from kvserve.engine.constraints import Constraint, constraint_of
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.ipc import CacheFlush, EngineStats, ModelFacts
from kvserve.engine.core.requests import Choice, Request, choice_output, choice_params
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.core.step_time import SchedulerOutput
from kvserve.engine.executor.executor import create_executor
from kvserve.engine.kv_cache.state_slots import state_stats
from kvserve.engine.layers.sampler import Sampler
from kvserve.engine.model_input import BlockTableWriter, block_table_width, build_model_input
from kvserve.engine.model_loader.generation_defaults import sampling_defaults
from kvserve.engine.model_loader.loader import load_generation_eos, load_hf_config, resolve_device
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import PLAIN, FinishReason, Sequence, Tenancy
from kvserve.engine.spec_decode.speculator import speculation_stats, speculator_for
from kvserve.engine.spec_decode.verify import sampling_rows
from kvserve.engine.structured.grammar import StructuredOutput
from kvserve.engine.tenancy.accounts import TenantAccounts
from kvserve.engine.tenancy.shares import TenantShares
from kvserve.engine.tenancy.step_trace import StepTrace
from kvserve.engine.tokenizer.detokenizer import RequestText
from kvserve.engine.tokenizer.load import load_tokenizer
from kvserve.engine.tokenizer.prompts import PromptEncoder

log = logging.getLogger("kvserve.engine")

COMPILE_WAIT_S = 0.05  # an idle engine waits this long for a grammar compile before stepping again


class LLMEngine:
    """``detokenize=False`` (the engine-core process) leaves the text to the front-end: outputs carry
    token ids only, and stop strings end a choice when the front-end calls ``stop_choice``."""

    def __init__(self, config: EngineConfig, detokenize: bool = True):
        self.detokenize = detokenize
        self.source = resolve_model(config.model)
        hf_config = load_hf_config(self.source)
        device_type = resolve_device(config.device).type
        config = config.replace(
            max_model_len=resolve_max_model_len(config, hf_config),
            max_num_batched_tokens=resolve_max_num_batched_tokens(config),
        )
        self.config = config
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = load_generation_eos(self.source, hf_config, self.tokenizer)
        self.executor = create_executor(config)
        self.vocab_size = self.executor.vocab_size
        self.model_name = self.source.name
        self.architecture = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
        self.block_manager = BlockManager(
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            windows=self.executor.kv_groups.windows, state_slots=self.executor.num_state_slots,
            state_snapshots=self.executor.num_state_snapshots if config.enable_prefix_caching else 0,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            self.eos_token_ids,
            max_step_time=resolve_max_step_time(config, device_type),
            last_prompt_token_alone=config.enable_prefix_caching,
            shares=TenantShares(config.scheduling_policy, config.weights(), config.max_running_per_tenant,
                                config.max_queued_per_tenant, config.tenant_row_cost,
                                config.tenant_linger_ms / 1000),
        )
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed)
        self.speculator = speculator_for(config, self.executor)
        self.structured = StructuredOutput(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                           config.grammar_compile_workers, config.grammar_compile_timeout)
        # which row of the runners' persistent block table each running sequence has
        self.block_tables = BlockTableWriter(
            config.max_num_seqs, block_table_width(config.max_model_len, config.block_size)
        )
        self.requests: dict[str, Request] = {}
        self._choices: dict[int, Choice] = {}  # by seq_id
        self._forks: dict[int, list[Sequence]] = {}  # choice 0's seq_id -> the choices to fork from it
        self._aborted: list[RequestOutput] = []
        self._rejected: list[tuple[str, BaseException]] = []
        self.started = time.monotonic()
        self.trace = StepTrace(config.step_trace) if config.step_trace else None  # --step-trace
        self.tenants = TenantAccounts()  # per-tenant series of /metrics
        self.counters = dict.fromkeys(
            ("requests_finished", "requests_aborted", "prompt_tokens_total", "generation_tokens_total"), 0
        )

    # ---- requests in ---------------------------------------------------------------------
    @functools.cached_property
    def prompts(self) -> PromptEncoder:
        """Checks and tokenizes prompts; made at first use (the engine core gets ids already checked)."""
        return PromptEncoder(self.tokenizer, self.vocab_size, self.config.max_model_len)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.prompts.encode(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.prompts.render_chat(messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises ValueError naming the field and the limit.

        A structured-output constraint is compiled on the grammar thread; the request is
        scheduled once it compiled, or comes out of ``take_rejected`` when it does not."""
        constraint = self._check_request(request_id, params)
        self._queue(request_id, self.encode_prompt(prompt), params, constraint)

    def add_tokenized(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      tenancy: Tenancy = PLAIN) -> None:
        """``add_request`` for a prompt that a ``PromptEncoder`` already produced and checked (the
        service's front-end does that off the engine core's loop): the ids are not checked again.
        ``tenancy``: the caller's tenant, priority and deadline (``TenantLimit`` or
        ``DeadlineUnreachable`` when it may not queue: engine/tenancy/shares.py)."""
        constraint = self._check_request(request_id, params)
        self._queue(request_id, prompt_token_ids, params, constraint, tenancy)

    def _check_request(self, request_id: str, params: SamplingParams) -> Constraint | None:
        """Refuse a taken id or bad parameters; returns the request's structured-output constraint."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params.validate(self.vocab_size)
        return constraint_of(params)

    def _queue(self, request_id: str, ids: list[int], params: SamplingParams,
               constraint: Constraint | None, tenancy: Tenancy = PLAIN) -> None:
        seqs = [Sequence(request_id, ids, choice_params(params, i), tenancy) for i in range(params.n)]
        self.scheduler.check_fits(seqs[0])  # raises when it could never fit
        self.scheduler.check_admission(seqs[0])
        choices = [Choice(seq, i) for i, seq in enumerate(seqs)]
        text = RequestText(self.tokenizer, ids, params) if self.detokenize else None
        req = Request(request_id, choices, unfinished=len(choices), text=text)
        self.requests[request_id] = req
        self._choices.update((c.seq.seq_id, c) for c in choices)
        if constraint is None:
            self._schedule(req)
        else:
            self.structured.submit(req, constraint)
        self.counters["prompt_tokens_total"] += len(ids)
        self.tenants.prompt(tenancy.tenant, len(ids))

    def _schedule(self, req: Request) -> None:
        """Hand choice 0 to the scheduler; the other choices fork from it after its prefill."""
        if len(req.choices) > 1:  # choices 1..n-1 fork from choice 0 after its prefill
            self._forks[req.seq.seq_id] = [c.seq for c in req.choices[1:]]
        self.scheduler.add(req.seq)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose constraint compiled; reject those whose did not."""
        idle = not self.scheduler.has_unfinished()
        for req, grammar in self.structured.take_compiled(COMPILE_WAIT_S if idle else 0.0):
            if isinstance(grammar, BaseException):
                self._drop(req)
                self._rejected.append((req.request_id, grammar))
                continue
            for c in req.choices:
                self.structured.attach(c.seq, grammar)
            self._schedule(req)

    def take_rejected(self) -> list[tuple[str, BaseException]]:
        """(request_id, error) of the requests refused after ``add_request``: a ValueError naming the
        constraint that does not compile, or CompilerFailed (the compiler died: the server's fault);
        they produce no output."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def _drop(self, req: Request) -> None:
        """Forget a request whose choices have all ended."""
        self.requests.pop(req.request_id, None)
        self._forks.pop(req.seq.seq_id, None)
        for c in req.choices:
            self._choices.pop(c.seq.seq_id, None)
            self.structured.detach(c.seq)

    def abort(self, request_id: str) -> bool:
        """End a request in any state; its blocks return to the pool now, its final output
        (finish_reason ABORT) comes out of the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.structured.cancel(req)
        for c in req.choices:
            if not c.seq.is_finished:
                self.scheduler.finish(c.seq, FinishReason.ABORT)
                self._aborted.append(choice_output(c, [], []))
        self._drop(req)
        self.counters["requests_aborted"] += 1
        return True

    def stop_choice(self, request_id: str, index: int) -> None:
        """End choice ``index`` of a request, whose stop string the front-end found in its text
        (finish reason STOP_STRING); the front-end sent its last output, so none comes from here."""
        req = self.requests.get(request_id)
        if req is None or req.choices[index].seq.is_finished:  # it ended meanwhile
            return
        self.scheduler.finish(req.choices[index].seq, FinishReason.STOP_STRING)
        self._choice_finished(req, req.choices[index].seq)

    # ---- the loop -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted or self._rejected)

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
        if self.structured.num_compiling:
            self._admit_compiled()
        started = time.perf_counter()  # the step's wall time trains the scheduler's time bound
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.structured)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        pairs, decode = (sched.attended_pairs, sched.decode_pairs) if self.scheduler.step_clock else (0, 0)
        if self.trace is not None:
            self.trace.planned(sched, self.scheduler, pairs, decode)
        self.block_tables.retain(seq.seq_id for seq in self.scheduler.running)
        inp = build_model_input(sched.scheduled, self.config.block_size, self.block_tables,
                                sched.state_copies, sched.state_rollbacks)
        model_started = time.perf_counter()
        logits = self.executor.execute_model(inp)
        if self.speculator is not None and inp.is_decode_only:  # what the policy's rows cost now
            self.speculator.observe_step(sched.num_tokens, time.perf_counter() - model_started)
        sampling = sched.sampling_seqs
        rows = sampling_rows(sched.scheduled)  # a row per sequence, and one per draft
        self.structured.mask_logits(logits, rows.seqs, rows.drafts)
        sampled = self.sampler(logits, rows.seqs, rows.drafts)  # prepare the batch, then sample
        runs = sampled.token_ids if len(rows) == len(sampling) else self.speculator.runs(sched.scheduled,
                                                                                          sampled.token_ids)
        for seq in self.structured.advance(sampling, runs):
            log.warning("request %s: its constraint allows no token of this vocabulary here; aborting "
                        "it after %d tokens", seq.request_id, seq.num_completion_tokens)
            self.scheduler.finish(seq, FinishReason.ABORT)
        if self._forks:
            self._fork_prefilled(sched)
        before = [seq.num_tokens for seq in sampling]
        self.scheduler.postprocess(sched, runs)  # the same sampling_seqs (cached)
        first_row = 0
        for seq, count, start in zip(sampling, rows.counts, before, strict=True):
            kept = seq.num_tokens - start  # a run ends early where a token ended the sequence
            self.counters["generation_tokens_total"] += kept
            self.tenants.generated(seq.tenancy.tenant, kept)
            lps = [lp for lp in sampled.logprobs[first_row : first_row + kept] if lp is not None]
            outputs.append(self._emit(self._choices[seq.seq_id], seq.token_ids[start:], lps))
            first_row += count
        seconds = time.perf_counter() - started
        if self.scheduler.step_clock:
            self.scheduler.step_clock.observe(sched.num_tokens, pairs, seconds, decode)
        if self.trace is not None:
            self.trace.ran(sched, seconds)
        return outputs

    def _fork_prefilled(self, sched: SchedulerOutput) -> None:
        """Fork the other choices of each request whose prompt was prefilled in this step, or whose
        step ended at its ``checkpoint_at`` (before ``postprocess``, which may finish choice 0 and free its
        blocks)."""
        for s in sched.scheduled:
            seq, end = s.seq, s.seq.num_computed_tokens + s.num_tokens
            forks_now = s.samples or end == seq.checkpoint_at
            if seq.num_completion_tokens == 0 and seq.seq_id in self._forks and forks_now:
                self.scheduler.fork(seq, self._forks.pop(seq.seq_id), state_at=end)

    def _emit(self, choice: Choice, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        seq = choice.seq
        out = choice_output(choice, tokens, logprobs)
        request = self.requests[seq.request_id]
        if request.text is not None and request.text.process(out) is RequestText.STOPPED:
            self.scheduler.finish(seq, FinishReason.STOP_STRING)  # ``out`` says so already
        if seq.is_finished:
            self._choice_finished(request, seq)
        return out

    def _choice_finished(self, request: Request, seq: Sequence) -> None:
        self.structured.detach(seq)
        request.unfinished -= 1
        if not request.unfinished:
            self._drop(request)
            self.counters["requests_finished"] += 1

    # ---- state ----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self.structured.num_compiling

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def is_healthy(self) -> bool:
        return self.executor.is_healthy()

    def stats(self) -> EngineStats:
        ex, blocks = self.executor, self.block_manager
        return EngineStats(
            model=self.model_name,
            device=str(ex.device),
            dtype=str(ex.dtype).removeprefix("torch."),
            tp_size=self.config.tensor_parallel_size,
            attention_backend=ex.attention_backend_name,
            num_waiting=self.num_waiting(),
            num_running=self.num_running(),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            kv_block_size=self.config.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            **state_stats(self.block_manager.state_slots, self.executor),
            prefix_cache_hit_rate=blocks.hit_rate,
            prefix_cache_queries=blocks.query_tokens,
            prefix_cache_hits=blocks.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            **self.counters,
            **speculation_stats(self.speculator and self.speculator.counters),
            uptime_s=time.monotonic() - self.started,
            tenants=self.tenants.snapshot(self.scheduler.running, self.scheduler.waiting),
        )

    def enable_kv_events(self) -> None:
        """Collect KV-cache events from now on (``take_kv_events``; the server publishes them)."""
        if self.block_manager.kv_events is None:
            self.block_manager.kv_events = []

    def take_kv_events(self) -> list[tuple]:
        return self.block_manager.take_kv_events()

    def reset_prefix_cache(self) -> CacheFlush:
        """Forget every cached prefix; refused while requests hold blocks (FlushCache)."""
        if self.block_manager.reset_prefix_cache():
            return CacheFlush(success=True)
        return CacheFlush(success=False, message=f"{self.num_running()} requests hold KV blocks; the prefix "
                          "cache is flushed only when idle")

    def model_info(self) -> ModelFacts:
        """Facts about the loaded model (the ModelInfo RPC's fields the engine knows)."""
        return ModelFacts(
            model=self.model_name,
            model_dir=self.source.path,
            architecture=self.architecture,
            max_model_len=self.config.max_model_len,
            vocab_size=self.vocab_size,
            dtype=str(self.executor.dtype).removeprefix("torch."),
            tp_size=self.config.tensor_parallel_size,
            eos_token_ids=list(self.eos_token_ids),
            kv_block_size=self.config.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.config.quantization or "",
            sampling_defaults=sampling_defaults(self.config.model),
            weight_formats=self.executor.weight_formats,
        )

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type: "int8", or the serving dtype's name."""
        if self.config.kv_cache_dtype != "auto":
            return self.config.kv_cache_dtype
        return str(self.executor.dtype).removeprefix("torch.")

    def shutdown(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.structured.shutdown()
        self.executor.shutdown()
