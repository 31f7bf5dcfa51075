"""Several HTTP front ends (`launch.py --api-server-count 2`): one real server (tiny model, CPU) for every check,
its two tokenizer processes both listening on the port. Many connections at once are answered, each by its own
request, and both processes take some; streams work on each; a client that goes away frees its KV; /metrics from
either reports both; a Responses follow-up and pins work whichever process gets them. Last, SIGKILL of one front
end stops the whole server with a message naming it (the module's last test: it ends the server the others share).
Unit tests of the outputs' split and of the DP controller's routing: tests/scheduler/test_front_end_outputs.py.

A test reaches a chosen front end through a keep-alive connection: new connections are opened until /server_info
(api_server_index) says the kernel put one on that process, which then serves every request on the connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time

import httpx
import pytest

from pin_checks import pin, pins, prompt_ids
from radixserve.runtime.process_util import process_tree_argv
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

FRONT_ENDS = 2
IDLE_WITHIN_S = 3.0
FIND_WITHIN_S = 30.0  # new connections until one lands on the front end wanted (each has an even chance)


@pytest.fixture(scope="module")
def server():
    with launched_server(tiny_model_dir("llama"), "--api-server-count", str(FRONT_ENDS)) as server:
        # /health answered once one front end listened; the other may start listening a moment later.
        for index in range(FRONT_ENDS):
            with client_on(server, index):
                pass
        yield server


@contextlib.contextmanager
def client_on(server, index: int):
    """An httpx client whose one keep-alive connection is served by front end `index`."""
    deadline = time.monotonic() + FIND_WITHIN_S
    while time.monotonic() < deadline:
        http = httpx.Client(base_url=server.url, timeout=60)
        info = http.get("/server_info").json()
        assert info["api_server_count"] == FRONT_ENDS
        if info["api_server_index"] == index:
            try:
                yield http
                if not http.is_closed:  # still the same process: the checks above really ran where they meant to
                    assert http.get("/server_info").json()["api_server_index"] == index
            finally:
                http.close()
            return
        http.close()
    raise AssertionError(f"no connection on front end {index} in {FIND_WITHIN_S} s")


def scrape(http: httpx.Client) -> dict[str, float]:
    """/metrics as {sample with its labels: value}."""
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")] = float(value)
    return samples


def per_front_end(samples: dict[str, float]) -> list[float]:
    return [samples.get(f'radixserve:api_server_requests_total{{api_server="{i}"}}', 0.0) for i in range(FRONT_ENDS)]


def test_many_connections_at_once_are_answered_by_both_front_ends(server):
    with client_on(server, 0) as http:
        before = per_front_end(scrape(http))

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:  # a connection per request in flight
            body = {"prompt": "Count with me:", "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(http.post("/v1/completions", json={**body, "max_tokens": 1 + i % 8}) for i in range(32))
            )

    for i, response in enumerate(asyncio.run(burst())):
        assert response.status_code == 200, response.text
        # Each answer is its own request's: the scheduler stopped each at its own length.
        assert response.json()["usage"]["completion_tokens"] == 1 + i % 8
        assert response.json()["choices"][0]["finish_reason"] == "length"
    with client_on(server, 1) as http:
        taken = [b - a for a, b in zip(before, per_front_end(scrape(http)))]
    assert sum(taken) == 32 and min(taken) > 0, taken


@pytest.mark.parametrize("index", range(FRONT_ENDS))
def test_streams_on_each_front_end(server, index):
    body = {
        "messages": [{"role": "user", "content": f"Hello front end {index}"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client_on(server, index) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"finish_reason":"length"' in "".join(events).replace(" ", "")
    assert '"completion_tokens":6' in events[-2].replace(" ", ""), events[-2]


def test_a_client_that_goes_away_frees_its_kv(server):
    body = {"prompt": "A very long story:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with client_on(server, 1) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
        gone = time.monotonic()
        http.close()  # and the client with it: client_on's own last look would be on another connection
    while (info := server.server_info())["num_running"] + info["num_waiting"]:
        assert time.monotonic() - gone < IDLE_WITHIN_S, info
        time.sleep(0.05)
    assert info["kv_invariant_ok"] and info["kv_owned"] == 0 and info["kv_protected"] == 0, info


def test_metrics_of_either_front_end_count_both(server):
    with client_on(server, 0) as zero, client_on(server, 1) as one:
        before = scrape(zero)
        for http, n in ((zero, 3), (one, 2)):
            for _ in range(n):
                response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
                assert response.status_code == 200, response.text
        finished = 'radixserve:requests_finished_total{finish_reason="length"}'
        for samples in (scrape(zero), scrape(one)):
            assert [b - a for a, b in zip(per_front_end(before), per_front_end(samples))] == [3, 2]
            assert samples[finished] - before[finished] == 5
            ttft = "radixserve:time_to_first_token_seconds_count"
            assert samples[ttft] - before[ttft] == 5
            assert samples["radixserve:num_requests_in_flight"] == 0


def test_a_responses_follow_up_finds_its_turn_on_the_other_front_end(server):
    body = {"input": "Name a city.", "max_output_tokens": 4}
    with client_on(server, 0) as zero, client_on(server, 1) as one:
        first = zero.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        first_id = first.json()["id"]
        second = one.post("/v1/responses", json={**body, "input": "Its river?", "previous_response_id": first_id})
        assert second.status_code == 200, second.text
        # The follow-up's prompt starts with the first turn's exact tokens, cached by the scheduler.
        assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        assert one.get(f"/v1/responses/{first_id}").json()["id"] == first_id
        assert zero.delete(f"/v1/responses/{second.json()['id']}").status_code == 200
        assert one.get(f"/v1/responses/{second.json()['id']}").status_code == 404


def test_pins_made_and_listed_from_either_front_end(server):
    with client_on(server, 0) as zero, client_on(server, 1) as one:
        # Prefixes not cached yet: each reply waits for its prefill, then goes to the front end that asked.
        made = [pin(http, input_ids=prompt_ids(first, 40))["id"] for first, http in ((7001, one), (7002, zero))]
        for http in (zero, one):
            assert set(made) <= set(pins(http))
            assert http.get("/v1/cache/stats").json()["num_pins"] == 2  # the dashboard's numbers, the same from both
        assert one.delete(f"/v1/cache/pin/{made[1]}").status_code == 200
        assert zero.delete(f"/v1/cache/pin/{made[0]}").status_code == 200
        assert not set(made) & set(pins(one))


def test_sigkill_of_one_front_end_stops_the_server_and_names_it(server):
    """Last: the server does not survive it."""
    [victim] = [
        pid
        for pid, argv in process_tree_argv(server.process.pid).items()
        if "tokenizer_service" in argv and argv[argv.index("--api-server-index") + 1 :][:1] == ["1"]
    ]
    lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"prompt": "On and on:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with client_on(server, 0) as http, http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) > 4:
                    streaming.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(30), lines
    os.kill(victim, signal.SIGKILL)
    reader.join(10)
    assert not reader.is_alive(), "the other front end's stream did not end"
    assert any("tokenizer-1 died" in line for line in lines), lines[-3:]  # an error event, not a normal end
    assert server.process.wait(timeout=20) == 1, server.log()[-2000:]
    assert re.search(r"tokenizer-1 \(pid \d+\) killed by signal SIGKILL", server.log()), server.log()[-2000:]
