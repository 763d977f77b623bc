"""Runs the model on one process, or on N tensor-parallel ranks behind the same surface.

``create_executor(config)`` returns the model runner itself for ``tensor_parallel_size == 1``
(a ``LocalExecutor``: a ``ModelRunner`` plus ``is_healthy``) and a ``TensorParallelExecutor``
otherwise. Both offer what the engine uses: ``num_kv_blocks``,
``execute_model``, ``vocab_size``, ``hf_config``, ``dtype``, ``device``,
``attention_backend_name``, ``weight_formats``, ``is_healthy`` and ``shutdown``.

The leader (rank 0) lives in the caller's process; ranks 1..N-1 are spawned worker processes
(engine/executor/worker.py) on this machine, plus those that ``kvserve worker`` starts on further
machines. Every step, the leader sends the step's ``ModelInput`` down the command channel and
then runs its own shard; the layers' collectives keep the ranks in lock-step.

The leader's model runner runs on one dedicated daemon thread so that the caller can stop
waiting when a worker dies: a collective with a dead peer may only return after its timeout
(gloo) or never (NCCL). While it waits, the caller checks the workers every half second. The
first death or failed step makes the executor unhealthy for good: every later call raises
``TensorParallelError`` and ``is_healthy()`` is False. ``shutdown`` reaps every worker.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.distributed import channels
from kvserve.engine.distributed.parallel import ParallelContext, divide, kv_head_shard
from kvserve.engine.executor.worker import WorkerProcesses, WorkerSpec, pin_device
from kvserve.engine.kv_cache.state_slots import refuse_linear_heads
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_loader.loader import load_hf_config, resolve_device
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.process.child_process import PipeDoorbell
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS

log = logging.getLogger("kvserve.engine.executor.executor")

LIVENESS_POLL_S = 0.5  # how often a waiting caller checks that the workers are alive
HEARTBEAT_S = 5.0  # idle period after which the leader pings workers on the dist channel
SHUTDOWN_GRACE_S = 5.0  # how long workers get to exit on their own before they are killed


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a worker died or a step failed)."""


def create_executor(config: EngineConfig) -> ModelRunner | TensorParallelExecutor:
    if config.tensor_parallel_size == 1 and config.nnodes == 1:
        return LocalExecutor(config)
    return TensorParallelExecutor(config)


class LocalExecutor(ModelRunner):
    """The model runner of a single-process engine, with the executor's health check."""

    def is_healthy(self) -> bool:
        return True  # no other process to lose; a failed step raises where it happens

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Nothing can break behind the caller's back here, so the listener is never called."""


def check_tensor_parallel(config: EngineConfig, hf_config: Any) -> None:
    """Refuse, before any process starts, a layout the engine cannot run."""
    tp, nnodes = config.tensor_parallel_size, config.nnodes
    if config.node_rank != 0:
        raise ValueError(f"node_rank={config.node_rank}: the engine runs on node 0; start the other "
                         "machines with `kvserve worker --node-rank R`")
    if tp % nnodes:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of nnodes ({nnodes})")
    if nnodes > 1 and config.master_port is None:
        raise ValueError("master_port must be set when nnodes > 1, so that the other machines can join")
    refuse_linear_heads(tp, hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    try:  # the layers' own rules, checked before any process starts
        divide(heads, tp, "num_attention_heads")
        kv_head_shard(kv_heads, 0, tp)
    except ValueError as exc:
        raise ValueError(
            f"tensor_parallel_size={tp} does not fit the model's attention heads "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}): {exc}"
        ) from None


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group, with the surface of a ModelRunner."""

    def __init__(self, config: EngineConfig, *, max_payload_bytes: int = channels.DEFAULT_MAX_PAYLOAD,
                 timeout_s: float = channels.DEFAULT_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S):
        check_tensor_parallel(config, load_hf_config(resolve_model(config.model)))
        self.config = config = config.replace(device=resolve_device(config.device).type)
        self.tp_size = config.tensor_parallel_size
        self.max_payload_bytes = max_payload_bytes
        self._timeout_s = timeout_s
        self._failure: str | None = None
        self._failure_lock = threading.Lock()
        self._failure_listeners: list[Callable[[str], None]] = []
        self._closed = False
        self._num_threads = torch.get_num_threads()  # the leader narrows it on CPU; restored at shutdown
        self._runner: ModelRunner | None = None
        self._group: Any = None  # the world group, once joined
        channel = channels.resolve_channel(config)
        self._store = channels.listen_store(config.master_addr, config.master_port, self.tp_size, timeout_s)
        channels.publish_launch(self._store, channels.Launch(config, max_payload_bytes, timeout_s))
        self._sender: channels.Sender | None = None  # the dist channel's comes with the groups
        self._workers = self._spawn_local_workers(channel)
        self._finalizer = weakref.finalize(self, _release, self._workers, self._sender, self._doorbells)
        self._workers.watch(self._on_worker_death)
        self._leader = _LeaderThread(self._heartbeat if channel == "dist" else None, heartbeat_s)
        try:
            self.num_kv_blocks: int = self._wait(self._leader.submit(self._start_leader))
        except BaseException:
            self.shutdown()
            raise
        runner = self._runner  # what the engine reads, kept past shutdown
        self.vocab_size: int = runner.vocab_size
        self.hf_config: Any = runner.hf_config
        self.dtype: torch.dtype = runner.dtype
        self.device: torch.device = runner.device
        self.attention_backend_name: str = runner.attention_backend_name
        self.kv_groups = runner.kv_groups  # the KV cache groups the block manager keeps blocks for
        # hybrids: every rank has the same slots (the same share of the heads, the same budget);
        # Stats report the state cache's bytes over all ranks, each holding 1 / tp_size of them
        self.num_state_slots: int = runner.num_state_slots
        self.num_state_snapshots: int = runner.num_state_snapshots
        self.state_cache_bytes_per_rank: int = runner.state_cache_bytes
        self.state_cache_bytes: int = runner.state_cache_bytes * self.tp_size
        self.weight_formats: list[str] = runner.weight_formats
        self._rank_exact_rows = runner.exact_rows()  # every rank's shards have rank 0's formats

    def _spawn_local_workers(self, channel: str) -> WorkerProcesses:
        """Ranks 1..local-1 on this machine (with their shared-memory channel, if it is used)."""
        local = self.tp_size // self.config.nnodes
        self._doorbells = [PipeDoorbell() for _ in range(local - 1)] if channel == "shm" else []
        if channel == "shm":
            self._sender = channels.ShmSender(self._doorbells, self.max_payload_bytes, self._timeout_s)
        specs = [WorkerSpec(rank, rank, self.config.master_addr, self._store.port, channel,
                            getattr(self._sender, "name", None)) for rank in range(1, local)]
        try:
            return WorkerProcesses.spawn(specs, self._doorbells, self._store)
        except BaseException:
            if self._sender is not None:
                self._sender.close()
            for doorbell in self._doorbells:
                doorbell.close()
            raise

    # ---- the ModelRunner surface --------------------------------------------------------------
    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        """Run one step on every rank; returns rank 0's logits."""
        self._raise_if_broken()
        cmd = channels.Command(channels.EXECUTE_MODEL, inp.to_bytes())
        channels.check_payload_size(cmd.nbytes, self.max_payload_bytes)  # before anything is sent
        return self._wait(self._leader.submit(lambda: self._step(cmd, inp)))

    def exact_rows(self) -> int | None:
        """``ModelRunner.exact_rows`` for the group: any count on a GPU; on the CPU the fewer of the
        rows the row kernel takes (``RowsAlike``: even where every projection is packed for gemm.c, a
        step's all-reduces over more rows were never shown to sum each row alike, up to
        MAX_FUSED_ROWS: tests/engine/executor/test_tp_speculation.py) and what rank 0's runner
        answers (GGUF block kernels, float layers: the same kinds of weight on every rank)."""
        if self.device.type != "cpu":
            return None
        return min(MAX_FUSED_ROWS, MAX_FUSED_ROWS if self._rank_exact_rows is None else self._rank_exact_rows)

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once, from any thread, when the group breaks (a worker
        dies, even while the engine is idle, or a step fails)."""
        self._failure_listeners.append(listener)

    def is_healthy(self) -> bool:
        if self._failure is None and not self._closed:
            death = self._workers.first_death()
            if death:
                self._fail(death)
        return self._failure is None and not self._closed

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids

    @property
    def worker_exitcodes(self) -> list[int | None]:
        return self._workers.exitcodes

    def shutdown(self) -> None:
        """Stop every rank: a clean stop when healthy, else kill; idempotent."""
        if self._closed:
            return
        healthy = self.is_healthy()
        self._closed = True
        self._workers.stop_watching()
        if not healthy:  # frees a leader thread stuck in a collective with a dead peer
            self._workers.reap(grace_s=0)
        done = self._leader.submit(lambda: self._close_leader(send_shutdown=healthy))
        wait_futures([done], timeout=SHUTDOWN_GRACE_S)
        if not done.done() or done.exception():
            log.warning("tensor-parallel leader did not close cleanly: %s",
                        done.exception() if done.done() else "timed out")
        self._workers.reap(grace_s=SHUTDOWN_GRACE_S)
        self._leader.stop(timeout=SHUTDOWN_GRACE_S)
        self._finalizer()
        # the groups hold the store: dropping them frees the rendezvous port for a next engine
        self._runner = self._group = self._sender = self._store = self._workers.store = None
        gc.collect()  # the model's layers (and their group) sit in reference cycles
        torch.set_num_threads(self._num_threads)

    # ---- the leader thread's work ---------------------------------------------------------------
    def _start_leader(self) -> int:
        """Rank 0's start-up, mirrored by every worker: groups, runner, handshake."""
        pin_device(self.config, 0)
        # join only once every rank is about to: a rank that died first would stall the join
        channels.wait_for_ranks(self._store, range(1, self.tp_size), lambda: self._closed, self._timeout_s)
        backend = channels.collective_backend(self.config.device)
        group, control = channels.init_groups(self._store, 0, self.tp_size, backend, self._timeout_s)
        self._group = group
        self._runner = ModelRunner(self.config, ParallelContext(0, self.tp_size, group))
        if self._sender is None:
            self._sender = channels.DistSender(control, self.max_payload_bytes)
        return channels.all_reduce_min(self._runner.num_kv_blocks, control)

    def _step(self, cmd: channels.Command, inp: ModelInput) -> torch.Tensor:
        self._sender.send(cmd)
        return self._runner.execute_model(inp)

    def _heartbeat(self) -> None:
        if self._failure is None and not self._closed and self._runner is not None:
            try:
                self._sender.send(channels.Command(channels.PING))
            except Exception as exc:
                self._fail(self._cause(wait_s=1.0) or f"heartbeat to the workers failed: {exc}")

    def _close_leader(self, send_shutdown: bool) -> None:
        try:
            if send_shutdown and self._runner is not None:
                self._sender.send(channels.Command(channels.SHUTDOWN))
        finally:
            if self._runner is not None:
                self._runner.shutdown()
            if self._group is not None:
                channels.destroy_groups()

    # ---- failure handling -------------------------------------------------------------------------
    def _wait(self, future: Future) -> Any:
        """The result of a leader-thread call, or TensorParallelError as soon as a worker dies."""
        while not future.done():
            wait_futures([future], timeout=LIVENESS_POLL_S)
            if not future.done():
                self._raise_if_broken()
        try:
            return future.result()
        except TensorParallelError:
            raise
        except Exception as exc:
            step_error = f"the leader's step failed: {type(exc).__name__}: {exc}"
            self._fail(self._cause(wait_s=1.0) or step_error)  # a failed collective: a peer dying?
            raise TensorParallelError(self._failure) from exc

    def _cause(self, wait_s: float) -> str | None:
        """Why the group broke, as far as this machine can tell: a local worker's death, or the
        error a worker on any machine left in the store before it exited."""
        death = self._workers.death_reason(wait_s)
        if death:
            return death
        for rank in range(1, self.tp_size):
            error = channels.reported_error(self._store, rank)
            if error:
                return f"tensor-parallel worker rank {rank} failed: {error}"
        return None

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor has been shut down")
        if not self.is_healthy():
            raise TensorParallelError(self._failure)

    def _on_worker_death(self, reason: str) -> None:
        if not self._closed:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = f"tensor-parallel engine is broken and must be restarted: {reason}"
        log.error("%s", self._failure)
        for listener in self._failure_listeners:
            listener(self._failure)


class _LeaderThread:
    """One daemon thread that runs, in order, every call on the leader's model runner.

    With ``on_idle`` it calls it whenever no call came for ``idle_s`` seconds."""

    def __init__(self, on_idle: Callable[[], None] | None = None, idle_s: float = HEARTBEAT_S):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._on_idle = on_idle
        self._idle_s = idle_s if on_idle else None
        self._thread = threading.Thread(target=self._loop, name="kvserve-tp-leader", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._calls.put((future, fn))
        return future

    def stop(self, timeout: float) -> None:
        self._calls.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                item = self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                self._on_idle()
                continue
            if item is None:
                return
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)


def _release(workers: WorkerProcesses, sender: channels.Sender | None, doorbells: list[PipeDoorbell]) -> None:
    """After shutdown, or as a last resort (garbage collection or interpreter exit): no orphans,
    no leftover segment, no open doorbell."""
    workers.reap(grace_s=0)
    workers.close()
    if sender is not None:
        sender.close()
    for doorbell in doorbells:
        doorbell.close()
