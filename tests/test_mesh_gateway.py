"""kvserve behind the real Shepherd Model Gateway (``smg==1.13.0`` from PyPI): two replicas of
the tiny random-weight Llama (with KV-cache events), the gateway on 127.0.0.1 with the
cache-aware policy over vLLM's engine protocol, driven as OpenAI clients are (the ``openai``
package: chat and completions, streaming and not). Greedy answers equal a replica's own
Generate; shared-prefix requests land on the replica holding the prefix; a client that hangs up
mid-stream frees the replica's blocks; killing one replica leaves the other serving."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import openai
import pytest

from kvserve.clients import Client
from kvserve.testing.gateway import Gateway
from kvserve.testing.process import ServerProcess
from kvserve.testing.random_model import write_random_model

# a dev dependency (pyproject.toml); its wheels are built for the common Linux and macOS machines
pytest.importorskip("smg", reason="smg (the gateway) is not installed: pip install -e '.[dev]'")

# the word-level test tokenizer has no chat template: this one marks roles with tokens of its own
CHAT_TEMPLATE = ("{% for m in messages %}<t1> {{ m['content'] }} <t2> {% endfor %}"
                 "{% if add_generation_prompt %}<t3>{% endif %}")
REPLICA_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--kv-events", "--seed", "1")


def words(start: int, count: int) -> str:
    return " ".join(f"<t{i}>" for i in range(start, start + count))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = write_random_model("llama-tiny", tmp_path_factory.mktemp("tiny"), seed=3)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def replicas(model_dir):
    servers = [ServerProcess("--model", str(model_dir), *REPLICA_FLAGS, env={"OMP_NUM_THREADS": "1"})
               for _ in range(2)]
    errors = []

    def start(s):
        try:
            s.start()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    with Gateway([s.target for s in replicas], "cache_aware") as gw:
        yield gw


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


def stats(server) -> dict:
    with Client(server.target) as c:
        return c.stats()


def test_greedy_answers_through_the_gateway_equal_a_replicas_own(oai, gateway, replicas):
    prompt = words(40, 12)
    with Client(replicas[0].target) as c:
        ours = c.generate(prompt, temperature=0, max_tokens=10)
        chat_ids = c.tokenize(messages=[{"role": "user", "content": words(60, 5)}])
        chat = c.generate(token_ids=chat_ids, temperature=0, max_tokens=10)
    done = oai.completions.create(model=gateway.model, prompt=prompt, max_tokens=10, temperature=0)
    assert done.choices[0].text.strip() == ours.text.strip()
    assert done.usage.prompt_tokens == 12 and done.usage.completion_tokens == 10
    streamed = oai.completions.create(model=gateway.model, prompt=prompt, max_tokens=10, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices).strip() == ours.text.strip()
    messages = [{"role": "user", "content": words(60, 5)}]
    reply = oai.chat.completions.create(model=gateway.model, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content.strip() == chat.text.strip()
    assert reply.usage.prompt_tokens == len(chat_ids)
    streamed = oai.chat.completions.create(model=gateway.model, messages=messages, max_tokens=10,
                                           temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text.strip() == chat.text.strip()


def test_shared_prefix_requests_land_on_the_replica_holding_the_prefix(oai, gateway, replicas):
    prefix = words(1000, 160)  # ten full blocks
    before = [stats(s)["requests_finished"] for s in replicas]
    for i in range(6):
        done = oai.completions.create(model=gateway.model, prompt=f"{prefix} {words(5000 + 3 * i, 3)}",
                                      max_tokens=2, temperature=0)
        time.sleep(0.3)  # the replica's KV events reach the gateway
    after = [stats(s) for s in replicas]
    served = [a["requests_finished"] - b for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 6], served
    holder = after[served.index(6)]
    assert holder["prefix_cache_hit_rate"] > 0
    assert done.usage.prompt_tokens_details.cached_tokens >= 160
    assert "Failed to subscribe to KV events" not in gateway.log_text()
    # the gateway followed the replicas' caches through their events
    assert gateway.metric("smg_kv_event_batches_total") > 0
    assert gateway.metric("smg_kv_event_blocks_total") >= 10


def test_the_gateways_flush_cache_reaches_every_replica(oai, gateway, replicas):
    prompt = f"{words(1000, 160)} {words(6000, 3)}"  # the prefix the previous test cached
    request = urllib.request.Request(gateway.url + "/flush_cache", data=b"{}", method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200, r.read()
    done = oai.completions.create(model=gateway.model, prompt=prompt, max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens_details.cached_tokens == 0


def test_a_client_that_hangs_up_mid_stream_frees_the_replicas_blocks(oai, gateway, replicas):
    stream = oai.completions.create(model=gateway.model, prompt=words(7000, 20), max_tokens=1500,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    end = time.monotonic() + 30
    while any(stats(s)["num_running"] for s in replicas):
        assert time.monotonic() < end, [stats(s) for s in replicas]
        time.sleep(0.1)
    for s in replicas:
        st = stats(s)
        assert st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.mark.slow  # ~25-30 s: 4 long streams, a SIGKILL and the gateway noticing; `make test-slow`
def test_killing_one_replica_leaves_requests_succeeding_on_the_other(oai, gateway, replicas):
    outcomes: list[str] = []

    def stream(i: int) -> None:  # long streams running on both replicas when the victim dies
        try:
            chunks = oai.completions.create(model=gateway.model, prompt=words(9000 + 40 * i, 20),
                                            max_tokens=300, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
            for _ in chunks:
                pass
            outcomes.append("done")
        except openai.APIError as e:  # the client sees the error: no hang
            outcomes.append(f"error: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # the victim is a replica that runs some of them (the policy may well put all four on one)
    end = time.monotonic() + 30
    while not any(stats(s)["num_running"] for s in replicas):
        assert time.monotonic() < end, "no stream reached a replica"
        time.sleep(0.05)
    time.sleep(0.5)
    counted = sorted(((stats(s)["num_running"], i) for i, s in enumerate(replicas)), reverse=True)
    running = [n for n, _ in counted]
    victim, survivor = (replicas[i] for _, i in counted)
    victim.signal(signal.SIGKILL)
    victim.wait(30)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and len(outcomes) == 4, outcomes
    # only the streams the victim was running may fail; those on the survivor finish
    assert sum(o != "done" for o in outcomes) <= running[0], (running, outcomes)
    before = stats(survivor)["requests_finished"]
    for i in range(4):
        done = oai.completions.create(model=gateway.model, prompt=words(8000 + 10 * i, 10), max_tokens=3,
                                      temperature=0)
        assert done.usage.completion_tokens == 3
    assert stats(survivor)["requests_finished"] - before == 4
