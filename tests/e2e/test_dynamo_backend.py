"""Two radixserve Dynamo workers behind Dynamo's own frontend (its KV router, and a second frontend that routes round
robin), all real processes on one host without etcd or NATS (tests/helpers/dynamo_fixture.py):

- the OpenAI routes through the official openai client; cache_salt keeps tenants apart end to end;
- 8 groups of chat requests sharing system prompts, interleaved: the KV router's prompt-token hit rate against one
  worker's (>= 95%), round robin's printed beside it;
- one worker evicting under memory pressure: requests routed after its evictions still find their prefix;
- streaming, an abort by a client that goes away (the worker frees the KV), and a worker killed mid-stream (its
  requests fail cleanly, the other worker's finish, and the frontend routes around it).

Requests are pinned to a worker where a test needs to know which one serves them (nvext.backend_instance_id, the
worker's Dynamo instance id, which its server_info control reports)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from dynamo_fixture import MODEL, REPO, Frontend, Worker, idle, serves, wait_for, wait_until_unlisted

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

GROUPS, ROUNDS = 8, 4
NO_EOS = {"ignore_eos": True}  # the tiny model samples freely and may end early on EOS


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    store, logs = tmp_path_factory.mktemp("dynamo-store"), tmp_path_factory.mktemp("dynamo-logs")
    procs = {
        "a": Worker(store, logs, "worker-a", "--max-total-tokens", "8192"),
        "b": Worker(store, logs, "worker-b", "--max-total-tokens", "8192"),
        "kv": Frontend(store, logs, "kv"),
        "rr": Frontend(store, logs, "round-robin"),
    }
    try:
        for name in ("a", "b"):
            wait_for(procs[name].ready, f"worker {name}", 180)
        for front in ("kv", "rr"):
            for name in ("a", "b"):
                wait_for(lambda: serves(procs[front], procs[name]), f"frontend {front} to see worker {name}", 60)
        procs["second"] = procs["b"]
        yield procs, store, logs
    except BaseException:
        for name, proc in procs.items():
            print(f"--- {name} ---\n{proc.tail()}")
        raise
    finally:
        for proc in set(procs.values()):
            proc.kill()


def client(front: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


def system_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "cache router prefix token block worker system prompt radix tree evict pin salt replica".split()
    return [f"You are assistant {g}. " + " ".join(rng.choice(words) for _ in range(110)) for g in range(GROUPS)]


def interleaved(systems: list[str], rounds: int, tag: str, seed: int = 1) -> list[tuple[int, list[dict]]]:
    """Round after round, one question per group, the groups in a new order each round (so that round robin, which
    alternates workers, splits every group over both)."""
    rng, order = random.Random(seed), []
    for r in range(rounds):
        groups = list(range(len(systems)))
        rng.shuffle(groups)
        order += [
            (
                g,
                [
                    {"role": "system", "content": systems[g]},
                    {"role": "user", "content": f"{tag} question {r} for group {g}?"},
                ],
            )
            for g in groups
        ]
    return order


def run(front: Frontend, requests, pin_to: int | None = None) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of each request, sent one after another."""
    c, usages = client(front), []
    for _, messages in requests:
        extra = {"nvext": {"backend_instance_id": pin_to}} if pin_to is not None else {}
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        usages.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
    return usages


def hit_rate(usages: list[tuple[int, int]]) -> float:
    return sum(c for _, c in usages) / sum(p for p, _ in usages)


def flush(*workers: Worker) -> None:
    for worker in workers:
        assert worker.control("flush_cache")["success"]
    time.sleep(0.5)  # the routers hear the removals over the event plane


def test_openai_routes_through_the_frontend(deployment):
    procs, _, _ = deployment
    c = client(procs["kv"])
    assert [m.id for m in c.models.list().data] == [MODEL]
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=NO_EOS
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    assert chat.choices[0].message.content
    completion = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 4 and completion.choices[0].text
    streamed = [
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="Once", max_tokens=4, stream=True, extra_body=NO_EOS)
        if ch.choices
    ]
    assert "".join(streamed)
    logprobs = c.completions.create(model=MODEL, prompt="Once", max_tokens=3, logprobs=2, extra_body=NO_EOS)
    assert len(logprobs.choices[0].logprobs.token_logprobs) == 3
    # response_format: radixserve's grammar holds the reply to the schema (Dynamo sends it as guided_decoding.json).
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # Stop strings reach radixserve's scheduler, which stops there (fewer tokens); the frontend cuts them from the
    # text. (With ignore_eos, Dynamo's frontend drops every stop condition.)
    free = c.completions.create(model=MODEL, prompt="The story begins", max_tokens=20, temperature=0)
    word = free.choices[0].text.split()[1]
    stopped = c.completions.create(model=MODEL, prompt="The story begins", max_tokens=20, temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].text
    assert free.choices[0].text.startswith(stopped.choices[0].text)
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    # What the frontend passes on but radixserve refuses is a 400 that names the problem.
    with pytest.raises(openai.BadRequestError, match="n > 1 is not supported"):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)

    # cache_salt end to end: the router hashes a salted prompt with its salt, so the second request of tenant t1
    # goes where t1's blocks are and finds them; tenant t2 and the shared cache see none of them.
    prompt = "Tenant data that must stay private: " + "alpha beta gamma delta " * 20
    usage = [
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}).usage
        for salt in ("t1", "t1", "t2")
    ]
    usage.append(c.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage)
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]
    assert cached[0] == 0 and cached[1] == usage[1].prompt_tokens - 1 and cached[2:] == [0, 0]


def test_kv_router_hit_rate_against_one_worker_and_round_robin(deployment):
    procs, _, _ = deployment
    a, b = procs["a"], procs["b"]
    requests = interleaved(system_prompts(), ROUNDS, "hit-rate")
    flush(a, b)
    single = hit_rate(run(procs["kv"], requests, pin_to=a.id))  # every request on one worker
    flush(a, b)
    kv = hit_rate(run(procs["kv"], requests))
    served = [a.info()["cached_prompt_tokens"], b.info()["cached_prompt_tokens"]]
    flush(a, b)
    rr = hit_rate(run(procs["rr"], requests))
    print(
        f"\nprompt-token hit rate, {GROUPS} groups x {ROUNDS} interleaved: one worker {single:.3f} | "
        f"Dynamo KV router {kv:.3f} ({kv / single:.1%} of one worker's) | round robin {rr:.3f}"
    )
    assert kv >= 0.95 * single
    assert min(served) > 0  # both workers served cached prefixes: the router spread the groups
    assert rr < kv


def test_router_follows_evictions_of_a_worker_under_memory_pressure(deployment):
    procs, store, logs = deployment
    a = procs["a"]
    # Room for about 3 system prompts; two tensor-parallel ranks (any radixserve layout serves Dynamo).
    tight = Worker(store, logs, "worker-c", "--max-total-tokens", "640", "--tp-size", "2")
    procs["c"] = tight
    wait_for(tight.ready, "worker c", 180)
    procs["b"].stop()  # two workers behind the routers: a (roomy) and c (tight)
    procs["second"] = tight
    for front in ("kv", "rr"):
        wait_for(lambda: serves(procs[front], tight), f"frontend {front} to see worker c", 60)
    systems = system_prompts(seed=7)

    def warm() -> None:
        """Every system prompt on both workers: c keeps only the last few, and evicts the others."""
        flush(a, tight)
        warmup = [
            (g, [{"role": "system", "content": s}, {"role": "user", "content": "warm up"}])
            for g, s in enumerate(systems)
        ]
        run(procs["kv"], warmup, pin_to=a.id)
        before = tight.info()["evicted_tokens"]
        run(procs["kv"], warmup, pin_to=tight.id)
        assert tight.info()["evicted_tokens"] > before
        time.sleep(0.5)

    warm()
    single = hit_rate(run(procs["kv"], interleaved(systems, 2, "reference"), pin_to=a.id))
    kv = hit_rate(run(procs["kv"], interleaved(systems, 2, "kv")))
    warm()
    rr = hit_rate(run(procs["rr"], interleaved(systems, 2, "rr")))
    print(
        f"\nafter worker c evicted (pool of 640 tokens): one roomy worker {single:.3f} | Dynamo KV router {kv:.3f} "
        f"({kv / single:.1%}) | round robin {rr:.3f}"
    )
    assert kv >= 0.95 * single
    assert rr < 0.9 * kv
    assert tight.info()["kv_invariant_ok"] and a.info()["kv_invariant_ok"]


def test_streaming_abort_and_a_worker_killed_mid_stream(deployment):
    procs, store, _ = deployment
    a, c = procs["a"], procs["second"]  # b, or c if the test before replaced b with it
    cl = client(procs["kv"])

    # Streaming: tokens arrive as they are made, usage at the end.
    chunks = list(
        cl.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks) >= 4
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8

    # A client that goes away: the frontend cancels, the worker aborts, and the scheduler frees the request's KV.
    # Worker a idle first, so that num_running below counts this request alone; and as long a request as the tiny
    # model's context (4,096) allows, so that it is still running when the client has read three events (once, in a
    # full-suite run on 2 cores, the poll below never saw it running within 10 s).
    wait_for(lambda: idle(a), "worker a idle before the long request", 30)
    long = {
        "model": MODEL,
        "prompt": "go on and on",
        "max_tokens": 4000,
        "stream": True,
        "nvext": {"backend_instance_id": a.id},
        **NO_EOS,
    }
    with httpx.stream("POST", f"{procs['kv'].url}/v1/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        # Running, with KV, before the client goes away. (Polled: once, in a full-suite run on 2 cores, the info
        # read right after the third event saw num_running 0.)
        wait_for(lambda: (lambda i: i["num_running"] == 1 and i["kv_owned"] > 0)(a.info()), "the request on a", 10)
    wait_for(lambda: idle(a), "the abort to reach worker a", 10)
    info = a.info()
    assert info["kv_owned"] == 0 and info["kv_invariant_ok"]

    # A worker killed mid-stream (SIGKILL, its engine's processes with it): its streams end with an error, the other
    # worker's finish, and new requests succeed once the frontend has dropped it.
    results: dict[str, object] = {}
    received = {f"{w}{i}": 0 for w in ("a", "c") for i in range(2)}

    def stream(name: str, worker: Worker, max_tokens: int) -> None:
        try:
            finish = None
            for piece in cl.completions.create(
                model=MODEL,
                prompt=f"story {name}",
                max_tokens=max_tokens,
                stream=True,
                extra_body={"nvext": {"backend_instance_id": worker.id}, **NO_EOS},
            ):
                received[name] += 1
                finish = piece.choices[0].finish_reason if piece.choices else finish
            results[name] = finish
        except openai.APIError as e:
            results[name] = e

    # a's streams run far longer than c's (whose pool, 640 tokens, holds two of 250): a is the one killed.
    threads = [
        threading.Thread(target=stream, args=(f"{w}{i}", worker, 250 if worker is c else 3000))
        for w, worker in (("a", a), ("c", c))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: min(received.values()) >= 3, "four streams under way", 30, 0.02)
    a.kill()
    for t in threads:
        t.join(timeout=120)
    assert results["c0"] == results["c1"] == "length", results
    assert isinstance(results["a0"], openai.APIError) and isinstance(results["a1"], openai.APIError), results
    assert max(received["a0"], received["a1"]) < 3000

    def routes_around_it() -> bool:
        for i in range(4):  # distinct prompts: with a still listed, some would be routed to it
            try:
                cl.completions.create(model=MODEL, prompt=f"after the kill {time.monotonic()} {i}", max_tokens=2)
            except openai.APIError:
                return False
        return True

    wait_until_unlisted(store, a.id)  # until then the router may still pick it (a 503)
    wait_for(routes_around_it, "the frontend to drop the killed worker", 60, 1.0)
    for i in range(6):
        assert (
            cl.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=2, extra_body=NO_EOS
            ).usage.completion_tokens
            == 2
        )
    assert c.info()["kv_invariant_ok"]


def test_a_bad_flag_or_model_is_one_line_and_exit_2():
    for flags in (["--model", "/nonexistent"], ["--port", "40000"]):
        proc = subprocess.run(
            [sys.executable, "-m", "radixserve.dynamo", "--device", "cpu", *flags],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and proc.stderr.startswith("python -m radixserve.dynamo: error: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
