"""The tensor-parallel command channel on its own: framing, the shared-memory segment's
permissions and lifetime, the size limit, and the out-of-step guard. No model, no processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import subprocess
import sys

import pytest

from kvserve.engine.distributed import channels
from kvserve.engine.model_input import ModelInput


def _model_input(num_tokens: int) -> ModelInput:
    return ModelInput(
        input_ids=list(range(num_tokens)),
        positions=list(range(num_tokens)),
        query_lens=[num_tokens],
        context_lens=[num_tokens],
        block_tables=[list(range((num_tokens + 15) // 16))],
        slot_mapping=list(range(num_tokens)),
        logits_indices=[num_tokens - 1],
    )


@pytest.fixture
def channel():
    doorbells = [mp.get_context("spawn").Semaphore(0) for _ in range(2)]
    sender = channels.ShmSender(doorbells, max_payload=4096, timeout_s=5)
    receivers = [channels.ShmReceiver(sender.name, i, doorbells[i], num_workers=2) for i in range(2)]
    yield sender, receivers
    for r in receivers:
        r.close()
    sender.close()


def test_command_round_trips_through_shared_memory_to_every_worker(channel):
    sender, receivers = channel
    inp = _model_input(20)
    for step in range(3):  # the same slot is reused once every worker took the previous command
        sender.send(channels.Command(channels.EXECUTE_MODEL, inp.to_bytes()))
        for r in receivers:
            cmd = r.recv()
            assert cmd.name == channels.EXECUTE_MODEL
            assert ModelInput.from_bytes(cmd.body) == inp, step
    sender.send(channels.Command(channels.SHUTDOWN))
    assert [r.recv() for r in receivers] == [channels.Command(channels.SHUTDOWN)] * 2


def test_segment_is_owner_only_and_removed_on_close():
    sender = channels.ShmSender([], max_payload=1024)
    path = f"/dev/shm/{sender.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sender.close()
    assert not os.path.exists(path)
    sender.close()  # idempotent


def test_attaching_leaves_the_creators_tracking_alone():
    """A receiver attached in the sender's own process (as in these tests) must not take the
    segment out of the process's resource tracker: the sender's unlink would then make the
    tracker fail (KeyError) and a segment leaked by a crash would stay behind."""
    program = (
        "from multiprocessing.shared_memory import SharedMemory\n"
        "from kvserve.engine.distributed.channels import attach_untracked\n"
        "s = SharedMemory(create=True, size=64)\n"
        "r = attach_untracked(s.name)\n"
        "r.close(); s.close(); s.unlink()\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_oversized_payload_raises_naming_size_and_limit_and_sends_nothing(channel):
    sender, receivers = channel
    big = channels.Command(channels.EXECUTE_MODEL, _model_input(2000).to_bytes())
    with pytest.raises(channels.PayloadTooLargeError, match=rf"{big.nbytes} bytes .* limit of 4096 bytes"):
        sender.send(big)
    small = channels.Command(channels.EXECUTE_MODEL, _model_input(3).to_bytes())
    sender.send(small)
    assert [r.recv() for r in receivers] == [small, small]


def test_sender_waits_for_workers_before_overwriting():
    doorbells = [mp.get_context("spawn").Semaphore(0)]
    sender = channels.ShmSender(doorbells, max_payload=1024, timeout_s=0.2)
    receiver = channels.ShmReceiver(sender.name, 0, doorbells[0], num_workers=1)
    try:
        sender.send(channels.Command(channels.PING))
        with pytest.raises(TimeoutError, match="did not take command 1"):
            sender.send(channels.Command(channels.PING))
        assert receiver.recv() == channels.Command(channels.PING)
    finally:
        receiver.close()
        sender.close()


def test_receiver_refuses_a_command_out_of_step(channel):
    sender, receivers = channel
    sender.send(channels.Command(channels.PING))
    receivers[0].recv()
    receivers[1]._seq = 5  # as if this worker had seen commands the leader never sent
    with pytest.raises(RuntimeError, match="out of step: expected command 6, got 1"):
        receivers[1].recv()


def test_launch_record_round_trips_as_json():
    from kvserve.engine.config import EngineConfig

    config = EngineConfig(tensor_parallel_size=2, num_kv_blocks=7)
    launch = channels.Launch(config, max_payload=123, timeout_s=9.0)
    assert channels.Launch.from_json(launch.to_json()) == launch


def test_shm_channel_is_refused_across_machines():
    from kvserve.engine.config import EngineConfig

    assert channels.resolve_channel(EngineConfig()) == "shm"
    assert channels.resolve_channel(EngineConfig(nnodes=2)) == "dist"
    with pytest.raises(ValueError, match="tp_channel='shm' works on one machine only, got nnodes=2"):
        channels.resolve_channel(EngineConfig(nnodes=2, tp_channel="shm"))
