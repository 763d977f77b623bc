"""A tensor-parallel worker (ranks 1..N-1): join the process groups, build the model runner
for its shard, then execute the leader's commands until it says ``shutdown``; and
``WorkerProcesses``, the starting process's handle on its workers (spawn, watch, stop).

``worker_main`` is what each worker process runs. The leader starts the workers of its own
machine; on every further machine of a multi-machine engine, ``run_node`` (also
``kvserve worker --node-rank R --master-addr A --master-port P``) starts that
machine's workers and waits for them. Workers take the engine config from the leader through
the rendezvous store, so every rank runs the same config.

Each worker is a fresh interpreter (``python -m kvserve worker --spec JSON ...``, see
engine/process/child_process.py), so the caller's main module is never re-imported: ``python -``,
``python -c`` and scripts without a ``__main__`` guard can start tensor-parallel engines.
A worker never outlives the process that started it: when the parent dies, its lifeline
pipe reaches EOF and the worker exits, so a killed leader leaves no orphans behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.distributed import channels
from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.model_input import ModelInput
from kvserve.engine.process.child_process import Child, Lifeline, PipeDoorbell, describe_exit, watch_lifeline
from kvserve.engine.process.gc_tuning import tune_gc
from kvserve.engine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerSpec:
    """Where one worker joins; the engine config itself comes from the store."""

    rank: int
    local_rank: int  # index among the ranks on this machine (its GPU)
    master_addr: str
    master_port: int
    channel: str  # "shm" or "dist"
    shm_name: str | None = None
    model: str | None = None  # this machine's path to the model, when it differs from the leader's


def worker_main(spec: WorkerSpec, doorbell=None) -> None:
    """Body of a worker process: start, then serve commands until ``shutdown``."""
    store = channels.connect_store(spec.master_addr, spec.master_port, channels.DEFAULT_TIMEOUT_S)
    try:
        launch = channels.fetch_launch(store)
        runner, receiver = _start(spec, launch, store, doorbell)
        tune_gc()
        _serve(runner, receiver)
    except BaseException as exc:
        channels.report_error(store, spec.rank, exc)
        raise
    finally:
        channels.destroy_groups()


def _start(spec: WorkerSpec, launch: channels.Launch, store,
           doorbell) -> tuple[ModelRunner, channels.Receiver]:
    """Mirror of the leader's start-up, in the same order: groups, runner, handshake."""
    config = launch.config if spec.model is None else launch.config.replace(model=spec.model)
    world = config.tensor_parallel_size
    pin_device(config, spec.local_rank)
    channels.announce_rank(store, spec.rank)
    backend = channels.collective_backend(config.device)
    group, control = channels.init_groups(store, spec.rank, world, backend, launch.timeout_s)
    if spec.channel == "shm":
        receiver = channels.ShmReceiver(spec.shm_name, spec.rank - 1, doorbell, world - 1)
    else:
        receiver = channels.DistReceiver(control, launch.max_payload)
    runner = ModelRunner(config, ParallelContext(spec.rank, world, group))
    channels.all_reduce_min(runner.num_kv_blocks, control)
    return runner, receiver


def _serve(runner: ModelRunner, receiver: channels.Receiver) -> None:
    while True:
        cmd = receiver.recv()
        if cmd.name == channels.EXECUTE_MODEL:
            runner.execute_model(ModelInput.from_bytes(cmd.body))
        elif cmd.name == channels.SHUTDOWN:
            runner.shutdown()
            receiver.close()
            return
        elif cmd.name != channels.PING:
            raise RuntimeError(f"unknown tensor-parallel command {cmd.name!r}")


def pin_device(config: EngineConfig, local_rank: int) -> None:
    """A GPU rank's device; on the CPU, ``ModelRunner`` shares the machine's CPUs among the ranks."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)


# ---- further machines ---------------------------------------------------------------------------
def run_node(node_rank: int, master_addr: str, master_port: int, model: str | None = None) -> int:
    """Run machine ``node_rank`` (>= 1) of a multi-machine engine until the leader ends it.

    Returns 0 when the leader shut the engine down, else the first failing worker's exit code.
    """
    if node_rank < 1:
        raise ValueError(f"node_rank must be >= 1 on a worker machine (0 is the leader), got {node_rank}")
    store = channels.connect_store(master_addr, master_port, channels.DEFAULT_TIMEOUT_S)
    config = channels.fetch_launch(store).config
    if node_rank >= config.nnodes:
        raise ValueError(f"node_rank must be < nnodes ({config.nnodes}), got {node_rank}")
    per_node = config.tensor_parallel_size // config.nnodes
    first = node_rank * per_node
    specs = [WorkerSpec(first + i, i, master_addr, master_port, "dist", model=model) for i in range(per_node)]
    workers = WorkerProcesses.spawn(specs, [], store)
    try:
        return workers.wait_all()
    finally:
        workers.close()


class WorkerProcesses:
    """The parent's handle on the worker processes it started, by rank: spawn, watch, stop."""

    def __init__(self, procs: dict[int, Child], store: Any):
        self._procs = procs
        self.store = store  # where workers leave their fatal errors
        self._lifeline = Lifeline()  # closed (or gone with this process): the workers exit
        self._stop_watch, self._stop_signal = mp.Pipe(duplex=False)

    @classmethod
    def spawn(cls, specs: list[WorkerSpec], doorbells: list[PipeDoorbell], store: Any) -> WorkerProcesses:
        """Start one fresh interpreter per spec (with ``doorbells[i]``'s read end, if any)."""
        workers = cls({}, store)
        try:
            for i, spec in enumerate(specs):
                args = ["--spec", json.dumps(dataclasses.asdict(spec)), "--lifeline-fd",
                        str(workers._lifeline.read_fd)]
                fds = [workers._lifeline.read_fd]
                if doorbells:
                    args += ["--doorbell-fd", str(doorbells[i].read_fd)]
                    fds.append(doorbells[i].read_fd)
                workers._procs[spec.rank] = Child("worker", args, pass_fds=tuple(fds))
        except BaseException:
            workers.reap(grace_s=0)
            workers.close()  # the pidfds of those already started
            raise
        finally:
            workers._lifeline.close_read_end()
            for doorbell in doorbells:
                doorbell.close_read_end()
        return workers

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self._procs.values()]

    def first_death(self) -> str | None:
        for rank, proc in self._procs.items():
            if proc.exitcode is not None:
                return self._describe(rank, proc)
        return None

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` from a daemon thread when the first worker exits."""
        if self._procs:
            threading.Thread(target=self._watch, args=(on_death,), name="kvserve-tp-watchdog",
                             daemon=True).start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        ready = wait_sentinels([p.sentinel for p in self._procs.values()] + [self._stop_watch])
        if self._stop_watch not in ready:
            on_death(self.death_reason(wait_s=2.0) or "a tensor-parallel worker exited")

    def stop_watching(self) -> None:
        self._stop_signal.send_bytes(b"stop")

    def death_reason(self, wait_s: float) -> str | None:
        """``first_death()``, waiting up to ``wait_s`` for a worker to die. A sentinel fires as
        the process closes its files, a moment before its exit status exists, and the thread
        that reaps it may be another one: so look again until the status shows."""
        deadline = time.monotonic() + wait_s
        while True:
            death = self.first_death()
            remaining = deadline - time.monotonic()
            if death or remaining <= 0 or not self._procs:
                return death
            ready = wait_sentinels([p.sentinel for p in self._procs.values()], remaining)
            for proc in self._procs.values():
                if proc.sentinel in ready:
                    proc.join(0.05)
            time.sleep(0.005)

    def reap(self, grace_s: float) -> None:
        """Join every worker; terminate, then kill, those still running after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            alive = [p for p in self._procs.values() if p.is_alive()]
            for proc in alive:
                getattr(proc, stop)()
            for proc in alive:
                proc.join(2.0)
        self._lifeline.close()

    def close(self) -> None:
        """Release the processes' pidfds; after ``reap`` (or ``wait_all``), once nobody waits on them."""
        for proc in self._procs.values():
            proc.close()

    def wait_all(self) -> int:
        """Wait for every worker; when one fails, stop the others. 0 if all exited cleanly, else
        the first failure's status (128 + signal for a killed one)."""
        pending = {p.sentinel: p for p in self._procs.values()}
        status = 0
        while pending:
            for sentinel in wait_sentinels(list(pending)):
                proc = pending.pop(sentinel)
                proc.join()
                if proc.exitcode and not status:
                    status = proc.exitcode if proc.exitcode > 0 else 128 - proc.exitcode
                    for other in pending.values():
                        other.terminate()
        return status

    def _describe(self, rank: int, proc: Any) -> str:
        what = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}"
        error = channels.reported_error(self.store, rank)
        return f"{what}: {error}" if error else what


def spawned_main(argv: list[str]) -> int:
    """A worker started by ``WorkerProcesses.spawn`` (not a command for people)."""
    parser = argparse.ArgumentParser(prog="kvserve worker --spec ...")
    parser.add_argument("--spec", required=True, help="WorkerSpec as JSON")
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--doorbell-fd", type=int)
    args = parser.parse_args(argv)
    watch_lifeline(args.lifeline_fd, lambda: os._exit(1))
    doorbell = PipeDoorbell(read_fd=args.doorbell_fd) if args.doorbell_fd is not None else None
    status = 0
    try:
        worker_main(WorkerSpec(**json.loads(args.spec)), doorbell)
    except BaseException:  # noqa: BLE001 - already reported to the leader through the store
        traceback.print_exc()
        status = 1
    # as multiprocessing's children do: skip interpreter finalization, where the process
    # groups' and the model's destructors can take seconds after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--spec":
        return spawned_main(argv)
    parser = argparse.ArgumentParser(
        prog="kvserve worker",
        description="Run the tensor-parallel workers of one further machine of a kvserve engine.",
    )
    parser.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1..nnodes-1")
    parser.add_argument("--master-addr", required=True, help="address of the leader (node 0)")
    parser.add_argument("--master-port", type=int, required=True, help="the leader's --master-port")
    parser.add_argument("--model", default=None, help="path of the model on this machine, if it differs")
    args = parser.parse_args(argv)
    try:
        return run_node(args.node_rank, args.master_addr, args.master_port, args.model)
    except ValueError as exc:
        parser.error(str(exc))

