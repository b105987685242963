"""`kiln serve --replicas 2` on a local Ray cluster: two engine replicas (own processes, own
small KV pools) behind one endpoint, driven with the official OpenAI SDK, and every route
family answering there as it does on one engine (route_calls.py), both drafting tokens
(--speculative ngram).

One cluster for the module (Ray and two model loads take a while on 2 cores); the fault test
runs last, as it kills a replica. Which replica served a request is read from /health's
per-replica request counts; a repeat on the replica that cached it shows in the usage
block's cached_tokens, a cold one does not.
"""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from api_server import MODEL, KilnServer
from route_calls import CALLS, RouteCall, comparable

pytest.importorskip("ray.serve", reason="the `cluster` extra (ray[serve]) is not installed")
pytestmark = pytest.mark.slow

BS = 16  # the KV cache's block size


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (Ray's GCS, raylet and workers are all under it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


# With drafting: the replicas draft as one engine does (speculative decoding's cluster test).
FLAGS = ("--kv-cache-tokens", "2048", "--ctx-len", "512", "--shutdown-timeout", "1",
         "--speculative", "ngram")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = KilnServer(tmp_path_factory.mktemp("kiln-cluster"), "--replicas", "2", *FLAGS)
    with s:
        s.ray_pids = descendants(s.proc.pid)
        yield s
        if s.proc.poll() is None:
            s.ray_pids |= descendants(s.proc.pid)
    ray_pids = s.ray_pids
    assert ray_pids, "the Ray cluster's processes should run under the server"
    deadline = time.monotonic() + 30
    while any(alive(p) for p in ray_pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = [p for p in ray_pids if alive(p)]
    assert not left, f"Ray processes left after the server stopped: {left}"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def replica_requests(server) -> dict[str, int]:
    """Requests each replica has taken (the ingress counts them as it routes)."""
    return server.health()["cluster"]["routing"]["by_replica"]


def served_by(server, before: dict[str, int]) -> dict[str, int]:
    """How many requests each replica took since `before`."""
    now = replica_requests(server)
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def complete(client, prompt: str, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=kw.pop(
        "max_tokens", 4), **kw)


def test_repeated_prefixes_land_on_the_replica_that_cached_them(server, client):
    # Raw prompts with nothing in common from their first token: a repeat reads cached
    # blocks only on the replica its first visit went to (a coin toss each, without routing).
    prompts = [f"{topic} is the subject of this short note, written for a curious reader "
               f"who knows nothing yet about {topic}." for topic in
               ("Volcanic geology", "Baroque music", "Sourdough baking", "Tidal energy",
                "Medieval cartography", "Honeybee dances")]
    before_routing = server.health()["cluster"]["routing"]
    before = replica_requests(server)
    firsts = [complete(client, p, temperature=0) for p in prompts]
    spread = served_by(server, before)
    assert len(spread) == 2, f"new prefixes should spread over both replicas: {spread}"
    repeats = [complete(client, p, temperature=0) for _ in range(2) for p in prompts]
    for r in repeats:
        n = r.usage.prompt_tokens
        # The whole prompt but its last token (always recomputed), in full blocks.
        assert r.usage.prompt_tokens_details.cached_tokens == (n - 1) // BS * BS
    routing = server.health()["cluster"]["routing"]
    usages = [r.usage for r in firsts + repeats]
    assert routing["requests_routed"] - before_routing["requests_routed"] == len(usages)
    assert routing["prefix_hits"] - before_routing["prefix_hits"] == \
        sum(u.prompt_tokens_details.cached_tokens > 0 for u in usages)
    assert routing["hit_tokens"] - before_routing["hit_tokens"] == \
        sum(u.prompt_tokens_details.cached_tokens for u in usages)
    # /metrics says the same (its counters are the same counters, read at scrape time).
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics", timeout=30).text) for s in f.samples}
    assert samples["kiln:cluster_prefix_hits_total"] >= routing["prefix_hits"]
    assert samples["kiln:cluster_requests_routed_total"] >= routing["requests_routed"]


def test_sixteen_concurrent_requests_all_complete_as_they_would_alone(server, client):
    questions = [f"In one sentence, what is {i} times {i + 3}?" for i in range(16)]
    kw = dict(model=MODEL, max_tokens=6, temperature=0)

    async def burst():
        async with server.async_client() as ac:
            return await asyncio.gather(*[ac.chat.completions.create(
                messages=[{"role": "user", "content": q}], **kw) for q in questions])

    before = replica_requests(server)
    together = asyncio.run(asyncio.wait_for(burst(), timeout=240))
    assert len(served_by(server, before)) == 2, "a burst should use both replicas"
    for q, r in zip(questions, together):
        alone = client.chat.completions.create(messages=[{"role": "user", "content": q}], **kw)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens > 0
        # CPU kernels: a greedy reply's bits do not depend on its batch or its replica.
        assert r.choices[0].message.content == alone.choices[0].message.content


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,"


def on_two_replicas(server, client, prompts: list[str]) -> tuple[str, str]:
    """Two of `prompts` whose first visits went to different replicas: each one's repeat
    goes back to its own (prefix affinity decides for requests sent one at a time, where
    load cannot: a load made of running streams ends early when drafting copies them)."""
    first_on: dict[str, str] = {}
    for prompt in prompts:
        before = replica_requests(server)
        complete(client, prompt, max_tokens=1)
        (replica,) = served_by(server, before)
        first_on.setdefault(replica, prompt)
        if len(first_on) == 2:
            return tuple(first_on.values())
    pytest.fail(f"new prefixes should spread over both replicas: {first_on}")


def test_sticky_settings_hold_across_replicas(server, client):
    # A full block (16 tokens) of its own in each, so the router remembers where it went;
    # greedy says hello, a penalty cannot. Drafted hellos skip the penalty, so with more
    # than 13 the model's own samples no longer meet one it changes (for some of the 8).
    setter_prompt, prompt = on_two_replicas(server, client, [
        f"Prompt {i}. " + " ".join(["hello"] * 13) for i in range(8)])
    before = replica_requests(server)
    # Temperature 0 and a presence penalty stick for the requests that follow.
    complete(client, setter_prompt, temperature=0, presence_penalty=2.0)
    (setter_replica,) = served_by(server, before)
    before = replica_requests(server)
    sticky = complete(client, prompt, max_tokens=12)  # no sampling field: the sticky ones
    (probe_replica,) = served_by(server, before)
    assert probe_replica != setter_replica
    explicit = complete(client, prompt, max_tokens=12, temperature=0, presence_penalty=2.0)
    plain = complete(client, prompt, max_tokens=12, temperature=0, presence_penalty=0.0)
    assert plain.choices[0].text != explicit.choices[0].text, "the penalty must matter here"
    assert sticky.choices[0].text == explicit.choices[0].text


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """One engine, with the cluster's flags."""
    with KilnServer(tmp_path_factory.mktemp("kiln-local"), *FLAGS) as s:
        yield s


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_every_route_answers_on_replicas_as_on_one_engine(server, local, call: RouteCall):
    answers = {}
    for name, s in (("one engine", local), ("replicas", server)):
        r = httpx.request(call.method, s.url + call.path, json=call.body, timeout=120)
        assert r.status_code == 200, (name, r.status_code, r.text[:800])
        answers[name] = comparable(call, r.text)
    assert answers["one engine"] == answers["replicas"]


def test_the_loaded_models_size_counts_every_replicas_kv_cache(server, local):
    local_size, cluster_size = (httpx.get(f"{s.url}/api/ps").json()["models"][0]["size"]
                                for s in (local, server))
    file_size = next(m["size"] for m in httpx.get(f"{local.url}/api/tags").json()["models"]
                     if m["name"] == MODEL)
    # Each replica holds a KV pool of the same size as the one engine's.
    assert cluster_size - file_size == 2 * (local_size - file_size) > 0


def _stream_until_error(server, body: dict, on_first) -> list[str]:
    """Raw SSE lines of a stream, to its end; on_first() runs after its first chunk."""
    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      timeout=httpx.Timeout(30.0)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if len(lines) == 1:
                    on_first()
    return lines


def test_a_dead_replica_loses_no_later_request_and_is_replaced(server, client):
    seeded = dict(temperature=0.9, seed=1234, max_tokens=8, logprobs=2)
    before = replica_requests(server)
    first = complete(client, COUNTING, **seeded)
    (victim_id,) = served_by(server, before)
    victim = next(r for r in server.health()["cluster"]["replicas"]
                  if r["replica"] == victim_id)

    def kill():  # the stream shares the prompt's prefix: it runs on the same replica
        os.kill(victim["pid"], signal.SIGKILL)

    lines = _stream_until_error(server, {"model": MODEL, "prompt": COUNTING + " 21,",
                                         "max_tokens": 400, "temperature": 0,
                                         "stream": True}, on_first=kill)
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "replica" in lines[-2], lines[-3:]

    # Sent after the death: every one is answered, by the replica left.
    after = [complete(client, COUNTING, **seeded)] + \
        [complete(client, f"After the fault, request {i} asks about rivers.") for i in range(3)]
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in after)
    again = after[0]
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # not the replica that had it
    # The seed gives the same reply, token for token, on the other replica.
    assert again.choices[0].text == first.choices[0].text
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = [r["pid"] for r in server.health()["cluster"]["replicas"]]
        if len(pids) == 2 and victim["pid"] not in pids:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the dead replica was not replaced: {server.health()['cluster']}")


def test_sigterm_ends_a_running_stream_with_abort_and_stops_the_cluster(server):
    # Last: it stops the server (the fixture then checks that no Ray process is left).
    server.ray_pids |= descendants(server.proc.pid)  # with the replaced replica
    lines = _stream_until_error(server, {"model": MODEL, "prompt": COUNTING, "max_tokens": 400,
                                         "temperature": 0, "stream": True},
                                on_first=lambda: server.proc.send_signal(signal.SIGTERM))
    assert lines[-1] == "data: [DONE]"
    finishes = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in lines[:-1]]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1, finishes[-3:]
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.log_text()
