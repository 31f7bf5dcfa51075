"""Two launch.py servers behind the real sglang-router (`python -m sglang_router.launch_router`, cache_aware), as a
user deploys them across machines: the OpenAI routes through the official openai client and /generate, streaming
and not; /flush_cache reaching both; --api-key on both sides, a wrong key refused; the worker contract the router
reads (/get_model_info, /get_server_info, /get_load); a server killed with SIGKILL taken out by the router's health
checks while requests keep succeeding."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.runtime.launcher import free_port
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
KEY = "router-test-key-0123"
# The tiny model samples at temperature 1, so any reply may end early on EOS; token counts are asserted without it.
NO_EOS = {"ignore_eos": True}


def start_server(port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RADIXSERVE_API_KEY": KEY}
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "--model",
            str(tiny_model_dir("llama")),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--max-total-tokens",
            "2048",
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, what: str, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def deployment():
    ports = [free_port(), free_port()]
    # The second server has two data-parallel replicas behind its own front end: the router sees one server.
    servers = [start_server(ports[0]), start_server(ports[1], "--dp-size", "2")]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    router_port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--worker-urls",
            *urls,
            "--policy",
            "cache_aware",
            "--api-key",
            KEY,
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "2",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for url in urls:
            wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, url, 180, servers)
        router_url = f"http://127.0.0.1:{router_port}"

        def router_sees_both():
            loads = httpx.get(f"{router_url}/get_loads", headers=auth(), timeout=5).json()["workers"]
            return len(loads) == 2 and all(w["load"] >= 0 for w in loads)  # -1: /get_load unreadable

        wait_for(router_sees_both, "the router to read both servers' /get_load", 120, [router])
        yield router_url, urls, servers
    finally:
        for proc in (router, *servers):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_servers_behind_sglang_router(deployment):
    router_url, urls, servers = deployment
    model = tiny_model_dir("llama").name
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=KEY, max_retries=0, timeout=60)

    # The worker contract, as the router reads it.
    info = httpx.get(f"{urls[0]}/get_model_info", headers=auth(), timeout=10).json()
    assert info["model_path"] and info["is_generation"] is True
    server_info = httpx.get(f"{urls[0]}/get_server_info", headers=auth(), timeout=10).json()
    assert server_info["served_model_name"] == model and server_info["dp_size"] == 1
    assert server_info["max_total_tokens"] == 2048 and server_info["api_key"] == "<redacted>"
    (load,) = httpx.get(f"{urls[0]}/get_load", headers=auth(), timeout=10).json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    loads = httpx.get(f"{urls[1]}/get_load", headers=auth(), timeout=10).json()
    assert [entry["dp_rank"] for entry in loads] == [0, 1]
    assert httpx.get(f"{urls[1]}/get_server_info", headers=auth(), timeout=10).json()["dp_size"] == 2
    metrics = httpx.get(f"{urls[1]}/metrics", headers=auth(), timeout=10).text
    assert all(f'dp_rank="{i}"' in metrics for i in (0, 1)) and "replica_num_running_reqs" in metrics

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=NO_EOS
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces)
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 5
    streamed = [
        c.choices[0].text
        for c in client.completions.create(model=model, prompt="Once", max_tokens=5, stream=True)
        if c.choices
    ]
    assert "".join(streamed)

    body = {"text": "The router", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r = httpx.post(f"{router_url}/generate", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 5, r.text
    with httpx.stream("POST", f"{router_url}/generate", json={**body, "stream": True}, headers=auth(), timeout=60) as r:
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert len(json.loads(events[-2])["output_ids"]) == 5

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router_url}/v1", api_key="wrong-key", max_retries=0).completions.create(
            model=model, prompt="hi", max_tokens=2
        )

    # A client that goes away aborts its request on whichever replica runs it.
    long = {"text": "go on", "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", f"{urls[1]}/generate", json=long, headers=auth(), timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_for(
        lambda: httpx.get(f"{urls[1]}/server_info", headers=auth(), timeout=10).json()["num_running"] == 0,
        "the abort to reach the replica",
        20,
    )

    # /flush_cache through the router empties both servers' caches (both replicas of the second).
    for url in urls:
        httpx.post(f"{url}/generate", json=body, headers=auth(), timeout=60).raise_for_status()
        assert httpx.get(f"{url}/server_info", headers=auth(), timeout=10).json()["kv_evictable"] > 0
    r = httpx.post(f"{router_url}/flush_cache", headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    for url in urls:
        assert httpx.get(f"{url}/server_info", headers=auth(), timeout=10).json()["kv_evictable"] == 0

    # One server dies without a word: the health checks take it out and every request still succeeds.
    servers[1].kill()
    servers[1].wait()

    probes = iter(range(1_000_000))

    def router_dropped_it():
        # /get_loads shows a failed load poll (-1) before the health check has taken the worker out of routing, so
        # that alone is not enough: the router must also serve distinct prompts (which cache-aware routing spreads
        # over both workers) four times in a row.
        workers = httpx.get(f"{router_url}/get_loads", headers=auth(), timeout=5).json()["workers"]
        if [w["worker"] for w in workers if w["load"] >= 0] != [urls[0]] and len(workers) != 1:
            return False
        for _ in range(4):
            r = httpx.post(
                f"{router_url}/v1/completions",
                headers=auth(),
                timeout=30,
                json={"model": model, "prompt": f"probe {next(probes)}", "max_tokens": 1},
            )
            if r.status_code != 200:
                return False
        return True

    # Requests sent in the moment between the kill and the health check depend on the router's retry timing,
    # which a loaded machine stretches; what we promise is the state once the check has run.
    wait_for(router_dropped_it, "the router's health check to drop the dead server", 60)
    for i in range(8):
        reply = client.completions.create(
            model=model, prompt=f"request {i} after the kill", max_tokens=3, extra_body=NO_EOS
        )
        assert reply.usage.completion_tokens == 3
    for i in range(4):
        assert (
            client.completions.create(
                model=model, prompt=f"again {i}", max_tokens=3, extra_body=NO_EOS
            ).usage.completion_tokens
            == 3
        )
