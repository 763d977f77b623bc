"""The gateway benchmark's workload (the run itself needs two servers and smg: minutes; its
figures are in docs/performance/gateway.md): prompts share their prefix per system prompt and
arrive interleaved."""

from kvserve.benchmarks.serving.gateway import prompts


def test_users_of_one_system_prompt_share_its_prefix_and_arrive_interleaved():
    texts = prompts(prefixes=3, users=2, prefix_words=20)
    assert len(texts) == 6 and len(set(texts)) == 6
    systems = [t.split("\n")[0] for t in texts]
    assert systems[:3] == systems[3:]  # prefix 0, 1, 2, then 0, 1, 2 again
    assert len(set(systems)) == 3 and all(len(s.split()) == 20 for s in systems)
