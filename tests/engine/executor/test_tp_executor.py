"""Tensor parallel end to end on CPU (gloo): N ranks give the greedy tokens and the float32
logits of one rank, over the shared-memory channel, the torch.distributed channel and the
across-machines entry; a killed worker breaks the engine loudly, never silently or by hanging;
shutdown leaves no process and no shared-memory segment behind.

Random-weight models come from small Qwen3-shaped configs written to a directory, so that every
rank loads the same checkpoint the way it loads a real one.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config

from kvserve.benchmarks.instruments.procfs import alive
from kvserve.benchmarks.scale.prefill import write_model
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.distributed.channels import PayloadTooLargeError
from kvserve.engine.executor.executor import (
    LocalExecutor,
    TensorParallelError,
    TensorParallelExecutor,
    create_executor,
)
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_loader.checkpoint import random_weights
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.tokenizer.load import load_tokenizer
from kvserve.kernels.cpu.kquant import kquant_kernels

BLOCK = 16
STEPS = 32


def write_random_model(directory, heads: int = 4, kv_heads: int = 2, vocab: int = 301) -> str:
    """A Qwen3-shaped checkpoint with seeded random weights (odd vocab: uneven vocab shards),
    and a word-level tokenizer so that the whole engine can load it."""
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
    )
    cfg.save_pretrained(directory)
    save_file({name: t.contiguous() for name, t in random_weights(cfg, seed=0)},
              os.path.join(directory, "model.safetensors"))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(directory)
    return str(directory)


def engine_config(model: str, tp: int, **changes) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", device="cpu", tensor_parallel_size=tp,
                        num_kv_blocks=32, max_model_len=256, **changes)


def greedy(executor, prompts: list[list[int]], joins: list[int] | None = None,
           after_step: Callable[[int], None] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding straight through ``execute_model`` for STEPS steps. Sequence i joins at
    step ``joins[i]``, so its prefill shares a batch with the others' decode tokens. Returns each
    sequence's new tokens and every step's logits."""
    joins = joins or [0] * len(prompts)
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    width = (max(map(len, prompts)) + STEPS) // BLOCK + 1
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(prompts))]
    step_logits = []
    for step in range(STEPS):
        active = [i for i in range(len(prompts)) if joins[i] <= step]
        inp = ModelInput()
        for i in active:
            start, end = computed[i], len(seqs[i])
            inp.input_ids += seqs[i][start:end]
            inp.positions += range(start, end)
            inp.slot_mapping += [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            inp.query_lens.append(end - start)
            inp.context_lens.append(end)
            inp.block_tables.append(tables[i])
            inp.logits_indices.append(len(inp.input_ids) - 1)
        logits = executor.execute_model(inp)
        for row, i in enumerate(active):
            computed[i] = len(seqs[i])
            seqs[i].append(int(logits[row].argmax()))
        step_logits.append(logits)
        if after_step:
            after_step(step)
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], step_logits


def assert_tp_matches_one_process(config: EngineConfig, tp: int, prompts, tol: float = 1e-4) -> None:
    """The same greedy run at ``tp`` ranks as in one process; afterwards every worker exited 0."""
    one = create_executor(config)
    try:
        reference = greedy(one, prompts, JOINS)
    finally:
        one.shutdown()
    many = create_executor(config.replace(tensor_parallel_size=tp))
    pids = many.worker_pids
    try:
        assert_same_run(greedy(many, prompts, JOINS), reference, tol=tol)
    finally:
        many.shutdown()
    assert many.worker_exitcodes == [0] * (tp - 1)
    assert_reaped(pids)


def assert_same_run(run, reference, tol: float = 1e-4) -> None:
    tokens, logits = run
    ref_tokens, ref_logits = reference
    assert tokens == ref_tokens
    for step, (got, want) in enumerate(zip(logits, ref_logits, strict=True)):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol,
                                   msg=lambda m, s=step: f"step {s}: {m}")


def assert_reaped(pids: list[int]) -> None:
    assert pids and not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments() -> set[str]:
    """This process's tensor-parallel segments (other engines on the machine make their own)."""
    return set(glob.glob(f"/dev/shm/kvserve-tp-{os.getpid()}-*"))


PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [8]]
JOINS = [0, 0, 3]


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory) -> str:
    return write_random_model(tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture(scope="module")
def qwen_reference(qwen_model):
    runner = create_executor(engine_config(qwen_model, tp=1))
    assert isinstance(runner, LocalExecutor) and runner.is_healthy()
    try:
        return greedy(runner, PROMPTS, JOINS)
    finally:
        runner.shutdown()


def test_qwen3_at_tp2_gives_the_run_of_tp1_and_refuses_an_oversized_payload(qwen_model, qwen_reference):
    segments = shm_segments()
    port = _free_port()
    config = engine_config(qwen_model, tp=2, master_port=port)
    executor = TensorParallelExecutor(config, max_payload_bytes=4096)
    pids = executor.worker_pids
    try:
        assert len(shm_segments() - segments) == 1
        assert executor.is_healthy() and executor.num_kv_blocks == 32 and executor.vocab_size == 301
        assert_same_run(greedy(executor, PROMPTS, JOINS), qwen_reference)
        n = 1000
        huge = ModelInput(input_ids=list(range(n)), positions=list(range(n)), query_lens=[n],
                          context_lens=[n], block_tables=[list(range(63))], slot_mapping=[-1] * n,
                          logits_indices=[n - 1])
        with pytest.raises(PayloadTooLargeError, match=r"of \d+ bytes exceeds the channel limit of 4096"):
            executor.execute_model(huge)
        assert executor.is_healthy()  # nothing was sent: the ranks are still in step
        assert_same_run(greedy(executor, PROMPTS, JOINS), qwen_reference)
    finally:
        executor.shutdown()
    assert not executor.is_healthy()
    assert executor.worker_exitcodes == [0]  # a clean stop, not a kill
    assert_reaped(pids)
    assert shm_segments() == segments
    socket.create_server(("127.0.0.1", port)).close()  # the rendezvous port is free for a next engine


def test_dist_channel_gives_the_same_run_with_heartbeats_in_between(qwen_model, qwen_reference):
    segments = shm_segments()
    executor = TensorParallelExecutor(engine_config(qwen_model, tp=2, tp_channel="dist"), heartbeat_s=0.02)
    pids = executor.worker_pids
    try:
        assert shm_segments() == segments  # the shared-memory path is off
        assert_same_run(greedy(executor, PROMPTS, JOINS), qwen_reference)
        time.sleep(0.5)  # idle: the leader pings the workers on the same stream
        assert executor.is_healthy()
        assert_same_run(greedy(executor, PROMPTS, JOINS), qwen_reference)
    finally:
        executor.shutdown()
    assert_reaped(pids)


def test_across_machines_entry_runs_the_other_node(qwen_model, qwen_reference):
    """Two "machines" on one: node 0 is this process (the leader), node 1 is started with the
    worker entry and takes its config from the leader."""
    port = _free_port()
    node = subprocess.Popen([sys.executable, "-m", "kvserve", "worker", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port)])
    try:
        executor = create_executor(engine_config(qwen_model, tp=2, nnodes=2, master_port=port))
        try:
            assert executor.worker_pids == []  # one rank per node: node 0 holds only the leader
            assert_same_run(greedy(executor, PROMPTS, JOINS), qwen_reference)
        finally:
            executor.shutdown()
        assert node.wait() == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_failing_worker_on_another_node_is_quoted_by_the_leader(qwen_model):
    port = _free_port()
    node = subprocess.Popen([sys.executable, "-m", "kvserve", "worker", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--model", "/nonexistent/model"], stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(TensorParallelError, match=r"worker rank 1 failed: ValueError: model "
                                                      r"'/nonexistent/model' is not"):
            create_executor(engine_config(qwen_model, tp=2, nnodes=2, master_port=port))
        assert node.wait() != 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_machine_that_never_joins_fails_the_start_with_a_hint(qwen_model):
    config = engine_config(qwen_model, tp=2, nnodes=2, master_port=_free_port())
    with pytest.raises(TensorParallelError, match=r"ranks \[1\] did not join within 1 s; .*kvserve worker"):
        TensorParallelExecutor(config, timeout_s=1.0)


def test_killed_worker_breaks_the_engine_loudly_and_leaves_no_orphans(tmp_path):
    model = write_random_model(tmp_path, heads=6, kv_heads=3)
    segments = shm_segments()
    executor = create_executor(engine_config(model, tp=3))
    pids = executor.worker_pids
    try:
        kill_at_step_4 = lambda step: step == 4 and os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            greedy(executor, PROMPTS, JOINS, after_step=kill_at_step_4)
        assert not executor.is_healthy()
        with pytest.raises(TensorParallelError, match="must be restarted"):
            executor.execute_model(ModelInput(input_ids=[1], positions=[0], query_lens=[1], context_lens=[1],
                                               block_tables=[[0]], slot_mapping=[0], logits_indices=[0]))
    finally:
        executor.shutdown()
    assert_reaped(pids)
    assert shm_segments() == segments


def test_worker_dying_while_idle_is_noticed_without_a_request(qwen_model):
    executor = create_executor(engine_config(qwen_model, tp=2))
    pids = executor.worker_pids
    broken = threading.Event()
    reasons = []
    executor.add_failure_listener(lambda reason: (reasons.append(reason), broken.set()))
    try:
        os.kill(pids[0], signal.SIGKILL)
        broken.wait()
        assert not executor.is_healthy()
        assert reasons == [reasons[0]] and "worker rank 1" in reasons[0] and "SIGKILL" in reasons[0]
    finally:
        executor.shutdown()
    assert_reaped(pids)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_qwen3_at_tp2_on_two_gpus_gives_the_run_of_one_gpu(qwen_model):
    config = engine_config(qwen_model, tp=1).replace(device="cuda")
    assert_tp_matches_one_process(config, 2, PROMPTS, tol=1e-3)


def test_workers_exit_when_the_leader_is_killed(qwen_model):
    segments = shm_segments()
    leader = subprocess.Popen([sys.executable, "-c", LEADER_SCRIPT, qwen_model], stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(pid) for pid in leader.stdout.readline().split()]
        assert len(pids) == 1
        leader.kill()
        leader.wait()
        while [pid for pid in pids if alive(pid)]:  # each worker notices its parent is gone
            time.sleep(0.1)
        while shm_segments() != segments:  # the resource tracker removes what the leader left
            time.sleep(0.1)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


LEADER_SCRIPT = """
import sys, time
from kvserve.engine.config import EngineConfig
from kvserve.engine.executor.executor import create_executor
executor = create_executor(EngineConfig(model=sys.argv[1], dtype="float32", device="cpu",
                                        tensor_parallel_size=2, num_kv_blocks=32, max_model_len=256))
print(*executor.worker_pids, flush=True)
time.sleep(600)
"""


def test_tp_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*num_attention_heads=9, "
                                         r"num_key_value_heads=3"):
        create_executor(EngineConfig(model="default", tensor_parallel_size=2))
    assert not mp.active_children()


def test_llm_at_tp2_generates_the_tokens_of_tp1(qwen_model):
    kwargs = dict(dtype="float32", num_kv_blocks=32, max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    tp1 = LLM(qwen_model, **kwargs)
    try:
        want = [o.token_ids for o in tp1.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        tp1.shutdown()
    tp2 = LLM(qwen_model, tensor_parallel_size=2, **kwargs)
    try:
        assert tp2.engine.is_healthy()
        assert [o.token_ids for o in tp2.generate(PROMPTS, params, use_tqdm=False)] == want
    finally:
        tp2.shutdown()
    assert not tp2.engine.is_healthy()


def test_default_model_at_tp3_gives_the_run_of_tp1():
    """SmolLM2 (9 query heads, 3 KV heads) split three ways, against one process."""
    config = EngineConfig(model="default", dtype="float32", num_kv_blocks=32, max_model_len=512)
    tokenizer = load_tokenizer(resolve_model("default"))
    prompts = [tokenizer.encode(t) for t in
               ("The three primary colors are", "def fibonacci(n):", "Paris is the capital of")]
    assert_tp_matches_one_process(config, 3, prompts)


@pytest.mark.skipif(kquant_kernels() is None, reason="the CPU kernels are not built here")
def test_a_q4_k_m_gguf_file_at_tp2_gives_the_run_of_tp1(tmp_path):
    """GGUF K-quant blocks split as stored: q/k/v/gate/up by rows, o/down by whole 256-value blocks of
    their inputs (512 / 2 and 1,536 / 2), each rank multiplying its shard where it lies in the file.
    float32 (dequantized panels): TP=1's run. bfloat16 (the block dots on int8 activations): the same
    tokens up to the first near-tie, every step's logits no further from TP=1's than bfloat16's own
    rounding puts TP=1 from float32 serving (random weights make logits of ~200: ties at bf16 ulps)."""
    path = tmp_path / "model-Q4_K_M.gguf"
    write_model(path, 2, 256, hidden=512, inter=1536, heads=8, kv_heads=4, vocab=4096)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256)
    runs = {}
    for dtype, tp in (("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)):
        executor = create_executor(config.replace(dtype=dtype, tensor_parallel_size=tp))
        try:
            runs[dtype, tp] = greedy(executor, PROMPTS, JOINS)
        finally:
            executor.shutdown()
    assert_same_run(runs["float32", 2], runs["float32", 1], tol=1e-3)
    noise = (runs["bfloat16", 1][1][0].float() - runs["float32", 1][1][0]).abs().max()
    (tokens, logits), (ref_tokens, ref_logits) = runs["bfloat16", 2], runs["bfloat16", 1]
    compared = 0
    for i, join in enumerate(JOINS):
        for step in range(join, STEPS):
            row = sum(j <= step for j in JOINS[:i])
            got, want = logits[step][row].float(), ref_logits[step][row].float()
            assert (got - want).abs().max() <= noise, (i, step)
            compared += 1
            if tokens[i][step - join] != ref_tokens[i][step - join]:
                top = want.topk(2).values
                assert top[0] - top[1] <= 2 * noise, (i, step)  # a near-tie: the runs part here
                break
    assert compared >= STEPS  # measured: 48 of 93 rows before the runs part
