"""Per-tenant accounts for /metrics: labels are short hashed identities, bounded in number (the rest
fold into "other" and keep being counted), refusals counted by reason, gauges read from the queues;
the collector exports them with a tenant label."""

from prometheus_client import CollectorRegistry, generate_latest

from kvserve.engine.frontend.engine_state import ServerStats
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence, Tenancy
from kvserve.engine.tenancy.accounts import OTHER, TenantAccounts, TenantStats, tenant_label
from kvserve.engine.tenancy.shares import DeadlineUnreachable, TenantLimit
from kvserve.service.telemetry.metrics import SnapshotCollector

RED = "header:" + "ab" * 32


def seq(tenant: str) -> Sequence:
    return Sequence(f"r-{tenant}", [1, 2, 3], SamplingParams(max_tokens=4), Tenancy(tenant))


def test_a_label_is_the_short_hashed_identity_and_the_one_tenant_is_default():
    assert tenant_label(RED) == "header:" + "ab" * 8
    assert tenant_label("") == "default"


def key(i: int) -> str:
    return "api-key:" + str(i) * 64


def test_tenants_beyond_the_cap_fold_into_other_and_labelled_ones_keep_their_label():
    accounts = TenantAccounts(max_labels=2)
    for i in range(5):
        accounts.generated(key(i), 10)
    accounts.prompt(key(0), 3)  # labelled first: still its own label
    by_label = {s.tenant: s for s in accounts.snapshot([seq(key(4))], [])}
    assert sorted(by_label) == sorted([tenant_label(key(0)), tenant_label(key(1)), OTHER])
    assert by_label[OTHER].generation_tokens == 30 and by_label[OTHER].running == 1
    assert by_label[tenant_label(key(0))].prompt_tokens == 3


def test_refusals_are_counted_by_reason_and_gauges_come_from_the_queues():
    accounts = TenantAccounts()
    accounts.refused(RED, TenantLimit("cap"))
    accounts.refused(RED, DeadlineUnreachable("late"))
    accounts.refused(RED, DeadlineUnreachable("late"))
    accounts.refused(RED, ValueError("max_tokens: bad"))  # the request's own fault: not a tenant refusal
    (red,) = accounts.snapshot([seq(RED), seq(RED)], [seq(RED)])
    assert (red.running, red.waiting) == (2, 1)
    assert red.refused == {"max_queued_per_tenant": 1, "deadline": 2}


def test_the_collector_exports_each_tenants_series_with_a_tenant_label():
    stats = ServerStats(model="m", device="cpu", dtype="float32", tp_size=1, attention_backend="torch",
                        num_waiting=0, num_running=0, kv_blocks_total=8, kv_blocks_free=8, kv_block_size=16,
                        kv_cache_dtype="auto", prefix_cache_hit_rate=0.0, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0, requests_finished=0, requests_aborted=0,
                        prompt_tokens_total=0, generation_tokens_total=0, spec_decode_num_drafts=0,
                        spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0,
                        spec_decode_acceptance_rate=0.0, spec_decode_mean_accepted_length=0.0, uptime_s=1.0,
                        num_queued=0, max_queue=8, requests_rejected=0,
                        tenants=[TenantStats("header:abab", 1, 2, 30, 7, {"deadline": 4})])
    registry = CollectorRegistry()
    registry.register(SnapshotCollector("m", lambda: stats))
    text = generate_latest(registry).decode()
    for line in ('kvserve:tenant_num_sequences_running{model_name="m",tenant="header:abab"} 1.0',
                 'kvserve:tenant_num_sequences_waiting{model_name="m",tenant="header:abab"} 2.0',
                 'kvserve:tenant_prompt_tokens_total{model_name="m",tenant="header:abab"} 30.0',
                 'kvserve:tenant_generation_tokens_total{model_name="m",tenant="header:abab"} 7.0',
                 'kvserve:tenant_requests_refused_total{model_name="m",reason="deadline",'
                 'tenant="header:abab"} 4.0'):
        assert line in text
