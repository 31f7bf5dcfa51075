"""The live cache dashboard (/dashboard, polling /v1/cache/stats) and the cache's Prometheus metrics, against a real
`launch.py` on the CPU with an API key, loaded in a real headless Chromium (Debian's `chromium`, which the README's
test command installs through scripts/install-test-browser.sh).

One server for the module: a pinned system prompt, then a shared-prefix workload in rounds about a second apart (the
front end keeps a sample of the counters per second, which the page's chart draws), then the page itself."""

from __future__ import annotations

import hashlib
import html.parser
import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from http_checks import assert_error_response
from radixserve.config import ServerArgs
from radixserve.protocol import unpack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.cache_stats import LARGEST_PREFIXES, cache_numbers, cache_stats, merge_cache_stats
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import SerialStepLoop
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are the radixserve dashboard test assistant. Answer briefly and kindly."
# Each question starts with its own word, so the pinned prompt ends where cached sequences part: it is a prefix of
# its own in the tree (RadixCache.largest_prefixes), not only the start of longer ones.
QUESTIONS = (
    " What is two plus two?",
    " Why is the sky blue?",
    " How do birds fly?",
    " Where is Paris?",
    " Which planet is red?",
    " Who wrote Hamlet?",
)
ROUNDS = 3
SALT = "tenant-secret-salt"
CHROMIUM = "/usr/bin/chromium"
BROWSER_TIMEOUT_S = 90


def assert_kv_parts_add_up(numbers: dict) -> None:
    parts = ("kv_free", "kv_cached", "kv_in_use", "kv_pinned")
    assert all(numbers[k] >= 0 for k in parts) and sum(numbers[k] for k in parts) == numbers["kv_total"], numbers


def test_scheduler_numbers_split_the_kv_pool_and_merge_over_replicas():
    """The scheduler side alone (a fake executor for the model): a running request that locks part of a pinned
    prefix moves that part from pinned to in use, every slot in exactly one part; --dp-size > 1 sums replicas."""
    scheduler = Scheduler(ServerArgs(device="cpu", max_running_requests=4), 1024, 256, [2])
    loop = SerialStepLoop(scheduler, FakeExecutor(1024, 4, 256))
    rng = np.random.default_rng(0)
    system = rng.integers(10, 1000, 40).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    scheduler.add_request(Req("a", system + [11, 12, 13], params))
    loop.run_until_idle()
    pin = scheduler.tree.pin(np.asarray(system[:30], dtype=np.int32))
    idle = cache_numbers(scheduler)
    assert_kv_parts_add_up(idle)
    assert (idle["kv_pinned"], idle["kv_in_use"], idle["num_pins"]) == (30, 0, 1)
    assert idle["kv_cached"] == 40 + 3 + 4 - 1 - 30  # prompt and outputs but the last output, minus the pin

    scheduler.add_request(Req("b", system[:20] + rng.integers(10, 1000, 60).tolist(), params))
    loop.step()  # b runs: it holds its 80 prompt tokens' KV, 20 of them shared with the pin (locked by b)
    busy = cache_numbers(scheduler)
    assert_kv_parts_add_up(busy)
    assert busy["kv_pinned"] == 10 and busy["kv_in_use"] == scheduler.running[0].kv_len == 80
    assert busy["prompt_tokens_cached"] == 20

    reply = cache_stats(scheduler, "r1")
    pinned = [p for p in reply.largest_prefixes if p.pinned and p.num_tokens == 30]
    assert len(pinned) == 1 and unpack_i32(pinned[0].first_tokens).tolist() == system[:30]
    loop.run_until_idle()
    assert scheduler.tree.unpin(pin.id)
    alone = cache_stats(scheduler, "r2")
    assert_kv_parts_add_up(alone.numbers)
    assert alone.numbers["kv_pinned"] == 0 and alone.numbers["num_running"] == 0

    merged = merge_cache_stats("r3", [alone, alone])
    assert merged.request_id == "r3"
    for key in ("kv_total", "kv_free", "kv_cached", "prompt_tokens_cached", "prompt_tokens_computed", "steps"):
        assert merged.numbers[key] == 2 * alone.numbers[key], key
    assert alone.numbers["cache_hit_rate"] > 0
    assert merged.numbers["cache_hit_rate"] == pytest.approx(alone.numbers["cache_hit_rate"])
    assert merged.numbers["eviction_policy"] == "lru"
    sizes = [p.num_tokens for p in merged.largest_prefixes]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == min(LARGEST_PREFIXES, len(alone.largest_prefixes))
    # The same prefix on two replicas is one row, with the hits of both.
    assert sorted(p.hits for p in merged.largest_prefixes) == sorted(2 * p.hits for p in alone.largest_prefixes)


@pytest.fixture(scope="module")
def server():
    # A small host tier (about 2,000 tokens of the tiny model's KV), so that the page shows one.
    with launched_server(tiny_model_dir("llama"), "--api-key", KEY, "--hicache-size", "0.001") as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def workload(http):
    """Pin the system prompt, then rounds of questions behind it; a stats request after each round records a
    sample of the counters (at most one a second) for the chart. Returns the pin."""
    pin = http.post("/v1/cache/pin", json={"prompt": SYSTEM}, headers=AUTH)
    assert pin.status_code == 200, f"POST /v1/cache/pin (helper cache-api's route): {pin.status_code} {pin.text}"
    last_sample = 0.0
    for _ in range(ROUNDS):
        for question in QUESTIONS:
            reply = http.post(
                "/v1/completions", json={"prompt": SYSTEM + question, "max_tokens": 3, "temperature": 0}, headers=AUTH
            )
            assert reply.status_code == 200, reply.text
        time.sleep(max(0.0, last_sample + 1.05 - time.time()))
        assert http.get("/v1/cache/stats", headers=AUTH).status_code == 200
        last_sample = time.time()
    # One tenant with its own namespace: the page may name it only by a digest of its salt.
    reply = http.post(
        "/v1/completions", json={"prompt": "A tenant's own prompt.", "max_tokens": 2, "cache_salt": SALT}, headers=AUTH
    )
    assert reply.status_code == 200, reply.text
    return pin.json()


def stats(http) -> dict:
    response = http.get("/v1/cache/stats", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def test_stats_need_the_api_key_and_the_page_does_not(http):
    assert_error_response(http.get("/v1/cache/stats"), 401, "API key")
    assert_error_response(http.get("/v1/cache/stats", headers={"Authorization": "Bearer wrong"}), 401)
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/dashboard.js">' in page.text and KEY not in page.text
    script = http.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "Authorization" in script.text and "innerHTML" not in script.text  # prompt text never parsed as HTML
    assert_error_response(http.get("/server_info"), 401)  # everything else keeps wanting the key


def test_stats_account_for_every_kv_slot_and_the_pin(http, workload):
    s = stats(http)
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_in_use"] == 0
    assert s["kv_free"] + s["kv_cached"] + s["kv_in_use"] + s["kv_pinned"] == s["kv_total"]
    assert s["num_pins"] == 1 and s["kv_pinned"] == workload["num_tokens"] > 0
    expected_computed_at_most = workload["num_tokens"] + ROUNDS * len(QUESTIONS) * 16 + 16
    assert 0 < s["prompt_tokens_computed"] <= expected_computed_at_most
    # Every question after the pin found at least the pinned tokens cached.
    assert s["prompt_tokens_cached"] >= ROUNDS * len(QUESTIONS) * workload["num_tokens"]
    assert s["cache_hit_rate"] == pytest.approx(
        s["prompt_tokens_cached"] / (s["prompt_tokens_cached"] + s["prompt_tokens_computed"])
    )
    assert s["eviction_policy"] == "lru" and s["hicache"] is True
    assert s["hicache_capacity_tokens"] > 1000 and s["hicache_tokens"] == s["hicache_hits"] == 0  # nothing evicted
    assert len(s["history"]["samples"]) >= ROUNDS
    times = [row[s["history"]["fields"].index("time")] for row in s["history"]["samples"]]
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    prefixes = s["largest_prefixes"]
    pinned = [p for p in prefixes if p["pinned"] and p["num_tokens"] == workload["num_tokens"]]
    assert len(pinned) == 1 and pinned[0]["text"] == SYSTEM and pinned[0]["tenant"] is None, prefixes
    assert pinned[0]["hits"] >= ROUNDS * len(QUESTIONS)
    assert [p["num_tokens"] for p in prefixes] == sorted((p["num_tokens"] for p in prefixes), reverse=True)
    tenant = [p for p in prefixes if p["tenant"] is not None]
    assert [p["tenant"] for p in tenant] == [hashlib.sha256(SALT.encode()).hexdigest()[:8]], prefixes
    assert SALT not in http.get("/v1/cache/stats", headers=AUTH).text


def test_metrics_show_the_cache(http, workload):
    s = stats(http)
    text = http.get("/metrics", headers=AUTH).text

    def value(name: str) -> float:
        found = re.search(rf"^radixserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    assert value("cache_hit_rate") == pytest.approx(s["cache_hit_rate"])
    assert value("cache_prompt_tokens_cached_total") == s["prompt_tokens_cached"] > 0
    assert value("cache_prompt_tokens_computed_total") == s["prompt_tokens_computed"]
    assert value("cache_pinned_tokens") == workload["num_tokens"] and value("cache_pins") == 1
    assert value("hicache_hits_total") == 0 and value("hicache_capacity_tokens") == s["hicache_capacity_tokens"]
    assert re.search(r'^radixserve:cache_evicted_tokens_total{.*policy="lru".*} 0\.0$', text, re.M), text


class DashboardDom(html.parser.HTMLParser):
    """The text of every element with an id, and the cells of the prefix table's rows with their data-pinned."""

    def __init__(self, dom: str):
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: list[tuple[str | None, list[str]]] = []
        self._open: list[str | None] = []  # ids of the open elements (None: no id)
        self._in_prefixes = False
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tbody" and attrs.get("id") == "prefixes":
            self._in_prefixes = True
        if self._in_prefixes and tag == "tr":
            self.rows.append((attrs.get("data-pinned"), []))
        if self._in_prefixes and tag == "td":
            self.rows[-1][1].append("")
        self._open.append(attrs.get("id"))
        if attrs.get("id"):
            self.by_id[attrs["id"]] = ""

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_prefixes = False
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for element_id in self._open:
            if element_id:
                self.by_id[element_id] += data
        if self._in_prefixes and self.rows and self.rows[-1][1]:
            self.rows[-1][1][-1] += data


def chromium(url: str, profile: Path, *mode: str) -> str:
    """Chromium's own headless mode: load the page, let its timers run for 5 s of virtual time (a stats poll
    answers first), then dump the DOM or take a screenshot. The network is closed, hence no background traffic."""
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: run scripts/install-test-browser.sh (as root)"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *mode,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_page_in_chromium(server, http, workload, tmp_path):
    page = f"{server.url}/dashboard"
    # Without the key in the fragment the stats are refused, and the page says how to give it.
    locked = DashboardDom(chromium(page, tmp_path / "profile-locked", "--dump-dom"))
    assert "API key needed" in locked.by_id["status"], locked.by_id["status"]
    assert locked.by_id["hit-rate"] == "–"

    dom = DashboardDom(chromium(f"{page}#key={KEY}", tmp_path / "profile", "--dump-dom"))
    assert dom.by_id["status"].startswith("updated"), dom.by_id["status"]
    s = stats(http)
    assert dom.by_id["model"] == s["model"]
    assert s["cache_hit_rate"] > 0
    assert float(dom.by_id["hit-rate"].rstrip("%")) == pytest.approx(100 * s["cache_hit_rate"], abs=0.05)
    assert dom.by_id["tokens-cached"] == f"{s['prompt_tokens_cached']:,}"
    assert dom.by_id["running"] == "0" and dom.by_id["waiting"] == "0"
    assert dom.by_id["kv-pinned-n"] == str(workload["num_tokens"])
    assert dom.by_id["pins"] == "1" and dom.by_id["policy"] == "lru"
    assert dom.by_id["host-tokens"] == "0" and f"of {s['hicache_capacity_tokens']:,} tokens" in dom.by_id["host-detail"]
    pinned_rows = [cells for pinned, cells in dom.rows if pinned == "true"]
    assert len(pinned_rows) == 1, dom.rows
    tokens, hits, _, pinned, tenant, text = pinned_rows[0]
    assert (tokens, pinned, tenant, text) == (str(workload["num_tokens"]), "pinned", "shared", SYSTEM)
    assert int(hits.replace(",", "")) >= ROUNDS * len(QUESTIONS)
    assert len(dom.rows) == len(s["largest_prefixes"]) > len(QUESTIONS)

    shot = tmp_path / "cache-dashboard.png"
    chromium(
        f"{page}#key={KEY}",
        tmp_path / "profile-shot",
        "--hide-scrollbars",
        "--window-size=1280,1180",
        f"--screenshot={shot}",
    )
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1280, 1180)
