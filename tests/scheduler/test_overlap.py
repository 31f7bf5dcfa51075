"""The overlapped step loop (OverlapStepLoop: step N+1 is built and launched before step N's tokens are applied)
against the serial one: the same greedy tokens, finish reasons and KV accounting in every scheduler scenario, with
the fake executor (many configurations, fast), the tiny model in this process, and the multi-process Engine."""

import numpy as np
import pytest

from radixserve.config import ServerArgs
from radixserve.protocol import unpack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import OverlapStepLoop, make_step_loop

CONTEXT_LEN = 512
EOS_IDS = list(range(10, 40))  # ids the fake executor samples (about 3% of them): some requests end on EOS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def make_loop(overlap: bool, num_kv_slots=4096, tokenizer=None, vocab_size=1000, **kw):
    kw.setdefault("max_running_requests", 16)
    args = ServerArgs(device="cpu", disable_overlap_schedule=not overlap, **kw)
    scheduler = Scheduler(args, num_kv_slots, CONTEXT_LEN, EOS_IDS, tokenizer)
    scheduler.check_invariant_every_step = True
    loop = make_step_loop(scheduler, FakeExecutor(num_kv_slots, args.max_running_requests, CONTEXT_LEN, vocab_size))
    assert isinstance(loop, OverlapStepLoop) == overlap
    return loop


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    roots = [rng.integers(10, 1000, int(rng.integers(5, 60))).tolist() for _ in range(3)]
    return [
        roots[i % 3][: int(rng.integers(1, len(roots[i % 3]) + 1))] + rng.integers(10, 1000, 5).tolist()
        for i in range(n)
    ]


def requests(ps, seed=0, **params):
    """Requests with various lengths; with ignore_eos=False some end on EOS (EOS_IDS)."""
    rng = np.random.default_rng(seed)
    params.setdefault("ignore_eos", True)
    return [
        Req(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=int(rng.integers(1, 20)), **params))
        for i, p in enumerate(ps)
    ]


def run(loop, reqs, abort_when=None):
    """Every output message, per request. abort_when: {rid: predicate(req, tokens delivered so far)}, checked
    before each step; the request is aborted the first time it holds (the same point in both loops)."""
    s = loop.scheduler
    for req in reqs:
        s.add_request(req)
    messages = {r.rid: [] for r in reqs}
    by_rid = {r.rid: r for r in reqs}
    steps = 0
    while loop.has_work():
        for rid, when in (abort_when or {}).items():
            delivered = [t for m in messages[rid] for t in unpack_i32(m.token_ids)]
            if by_rid[rid].status is not ReqStatus.FINISHED and when(by_rid[rid], delivered):
                assert s.abort(rid)
        for out in loop.step():
            messages[out.req.rid].append(out.to_message())
        steps += 1
        assert steps < 10_000
    assert_idle(s)
    assert all(r.status is ReqStatus.FINISHED for r in reqs)
    return {r.rid: (r.output_ids, r.finish_reason, summarize(messages[r.rid])) for r in reqs}


def summarize(messages):
    """What the front end sees: every token, the last message's counts and reason."""
    tokens = [t for m in messages for t in unpack_i32(m.token_ids).tolist()]
    last = messages[-1]
    assert last.finished and all(not m.finished for m in messages[:-1])
    return tokens, last.finish_reason, last.completion_tokens, last.matched_stop


def assert_idle(s):
    s.check_invariant(walk_tree=True)
    assert not s.running and not s.waiting
    u = s.kv_usage()
    assert u["protected"] == u["owned"] == 0 and u["free"] + u["evictable"] == u["total"]


def both(config, reqs_fn, **run_kw):
    """Run with the serial and the overlapped loop; everything a request got must be the same."""
    serial, overlap = (run(make_loop(o, **config), reqs_fn(), **run_kw) for o in (False, True))
    assert overlap == serial
    assert all(min(out) >= 0 for out, _, _ in serial.values() if out)
    return serial


CONFIGS = [
    dict(),
    dict(chunked_prefill_size=7),
    dict(chunked_prefill_size=-1),
    dict(disable_mixed_batch=True, chunked_prefill_size=5),
    dict(disable_radix_cache=True, chunked_prefill_size=7),
    dict(schedule_policy="fcfs"),
    dict(max_running_requests=3),
    dict(num_kv_slots=200, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_fake_executor_same_outputs_with_and_without_overlap(config):
    ps = prompts(30)
    serial = both(config, lambda: requests(ps, ignore_eos=False))
    assert {reason for _, reason, _ in serial.values()} == {"stop", "length"}, "EOS and max_tokens both occur"


def test_retraction_with_overlap_applies_the_step_in_flight_first():
    config = dict(num_kv_slots=100, init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    ps = [list(range(10 + 50 * i, 40 + 50 * i)) for i in range(3)]
    both(
        config,
        lambda: [
            Req(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)) for i, p in enumerate(ps)
        ],
    )
    loop = make_loop(True, **config)
    run(
        loop,
        [Req(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)) for i, p in enumerate(ps)],
    )
    assert loop.scheduler.stats.retractions > 0


ABORT_POINTS = {
    "waiting": lambda req, delivered: True,
    "mid_prefill": lambda req, delivered: req.kv_len > 0 and not delivered,
    "after_first_token": lambda req, delivered: len(delivered) >= 1,
    "mid_decode": lambda req, delivered: len(delivered) >= 4,
}


@pytest.mark.parametrize("point", ABORT_POINTS)
def test_aborts_at_every_stage(point):
    ps = [p * 3 for p in prompts(8, seed=3)]  # long enough to take several chunks
    make = lambda: [  # noqa: E731
        Req(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(ps)
    ]
    when = ABORT_POINTS[point]
    results = both(dict(chunked_prefill_size=9), make, abort_when={"r1": when, "r5": when})
    assert results["r1"][1] == results["r5"][1] == "abort"


def test_stop_strings_with_overlap(tokenizer):
    ps = prompts(12, seed=5)
    reference = run(make_loop(False, vocab_size=2000), requests(ps, seed=5))
    # Stop at a piece of text some outputs contain: the scheduler decides it, one token late would show.
    stops = sorted({tokenizer.decode(out[2:4])[:3] for out, _, _ in reference.values() if len(out) > 4})[:4]
    results = both(dict(tokenizer=tokenizer, vocab_size=2000), lambda: requests(ps, seed=5, stop=stops))
    assert any(reason == "stop" for _, reason, _ in results.values())


def test_a_request_that_ends_by_length_takes_no_step_after_its_last_token():
    """Its last token's step is known at launch: the overlapped loop schedules nothing more for it (a max_tokens=1
    request is one forward), and the KV invariant holds after every step (run() checks it)."""
    for max_new_tokens, steps in [(1, 1), (3, 3)]:
        params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        loop = make_loop(True)
        req = Req("one", list(range(20, 40)), params)
        run(loop, [req])
        assert len(loop.executor.batches) == steps  # the prefill, then one decode per further token
        assert req.output_ids == run(make_loop(False), [Req("one", list(range(20, 40)), params)])["one"][0]
        assert len(req.output_ids) == max_new_tokens and min(req.output_ids) >= 0


def test_a_request_that_stops_on_a_token_wastes_one_decode_and_frees_its_slot_once():
    """A stop (here: EOS) is known only once the token is back, so the step after it, launched before, decodes a
    placeholder for it; that slot goes back exactly once (run() checks the invariant at idle)."""
    serial = make_loop(False)
    probe = Req("probe", list(range(20, 40)), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    run(serial, [probe])
    eos = probe.output_ids[1]  # the fake model's second token: make it the stop token
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[eos])
    loop = make_loop(True)
    req = Req("one", list(range(20, 40)), params)
    run(loop, [req])
    batches = loop.executor.batches
    assert req.output_ids == probe.output_ids[:2] and req.finish_reason == "stop"
    assert len(batches) == 3, "prefill, a decode, and one decode launched before the stop token was known"
    assert unpack_i32(batches[-1].input_ids)[0] < 0, "the wasted step decodes a placeholder"


# ---------------------------------------------------------------- tiny model, in this process and multi-process


def tiny_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 49152, int(rng.integers(5, 40))).tolist() for _ in range(3)]
    return [
        roots[i % 3][: int(rng.integers(1, len(roots[i % 3]) + 1))] + rng.integers(0, 49152, 8).tolist()
        for i in range(n)
    ]


def tiny_params(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        SamplingParams(temperature=0.0, max_new_tokens=int(rng.integers(1, 16)), ignore_eos=bool(i % 2))
        for i in range(n)
    ]


# tests/scheduler/test_scheduler_on_a_tiny_model.py runs another scenario with the tiny model through the default
# (overlapped) loop against a serial one-at-a-time reference.
@pytest.mark.parametrize(
    "config",
    [
        dict(chunked_prefill_size=7),
        dict(
            max_total_tokens=80,
            disable_mixed_batch=True,
            chunked_prefill_size=16,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.01,
        ),
    ],
)
def test_in_process_engine_same_outputs_with_and_without_overlap(config):
    from scheduler_service.in_process_engine import InProcessEngine

    ps, params = tiny_prompts(8), tiny_params(8)
    config = {"max_total_tokens": 4096, "max_running_requests": 16, **config}
    results, retractions = {}, {}
    for overlap in (False, True):
        engine = InProcessEngine(
            str(tiny_model_dir("llama")), device="cpu", disable_overlap_schedule=not overlap, **config
        )
        engine.scheduler.check_invariant_every_step = True
        results[overlap] = [(r.token_ids, r.finish_reason, r.text) for r in engine.generate(ps, params)]
        retractions[overlap] = engine.scheduler.stats.retractions
        while engine.loop.has_work():  # the wasted step of the last requests may still be in flight
            engine.loop.step()
        assert_idle(engine.scheduler)
    assert results[True] == results[False]
    if config["max_total_tokens"] < 200:
        assert retractions[True] > 0, "a pool this small must retract"


@pytest.mark.server
def test_multi_process_engine_same_outputs_with_and_without_overlap():
    from radixserve.engine import Engine

    ps, params = tiny_prompts(6, seed=2), tiny_params(6, seed=2)
    results = {}
    for overlap in (False, True):
        with Engine(
            str(tiny_model_dir("llama")),
            device="cpu",
            max_total_tokens=2048,
            chunked_prefill_size=16,
            disable_overlap_schedule=not overlap,
        ) as engine:
            results[overlap] = [(r.token_ids, r.finish_reason) for r in engine.generate(ps, params)]
            info = engine.server_info()
            assert info["kv_invariant_ok"] and info["num_running"] == 0
    assert results[True] == results[False]
