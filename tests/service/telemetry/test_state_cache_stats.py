"""The state cache of a linear-attention hybrid (a tiny random Qwen3.5) as a real server reports
it: the Stats RPC and /metrics carry its slots, snapshots and bytes, and every slot is free again
once a request has finished."""

from __future__ import annotations

import pytest
import torch

from kvserve.clients import Client
from kvserve.testing.plugin import TEST_SERVER_ENV, wait_until_idle
from kvserve.testing.process import ServerProcess
from kvserve.testing.random_model import make_config, write_model_dir

STATE_METRICS = {"kvserve:state_slots": "state_slots_total", "kvserve:state_slots_free": "state_slots_free",
                 "kvserve:state_snapshots": "state_snapshots_total",
                 "kvserve:state_snapshots_cached": "state_snapshots_cached",
                 "kvserve:state_snapshot_hits_total": "state_snapshot_hits",
                 "kvserve:state_cache_bytes": "state_cache_bytes"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3.5")
    path = write_model_dir(make_config("qwen3.5-tiny"), out, dtype=torch.float32)
    flags = ("--model", str(path), "--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "4",
             "--metrics-port", "0")
    with ServerProcess(*flags, env=TEST_SERVER_ENV) as srv:
        yield srv
        assert srv.stop() == 0, srv.log_tail()


def test_stats_and_metrics_report_the_state_slots_all_free_after_a_request(server):
    prefix = [(7 * i) % 400 + 5 for i in range(64)]
    with Client(server.target) as client:
        before = client.stats()
        assert before["state_slots_total"] == before["state_slots_free"] == 4
        assert before["state_snapshots_total"] == 4 and before["state_cache_bytes"] > 0
        for tail in ([1, 2, 3], [4, 5, 6]):  # the second hits the first's 64-token snapshot
            done = client.generate(token_ids=prefix + tail, temperature=0, max_tokens=8, ignore_eos=True)
            assert len(done.token_ids) == 8
        after = wait_until_idle(client)
    assert after["state_slots_free"] == after["state_slots_total"] == 4
    assert after["state_snapshots_cached"] >= 1 and after["state_snapshot_hits"] == 1
    samples = server.metrics()
    for metric, field in STATE_METRICS.items():
        assert samples[(metric, ())] == after[field], metric
