"""The scheduler driven through its real step loop (SerialStepLoop) by a fake executor: no model, but tokens that
hash each request's whole context read back through the fake's own KV cache and req_to_token table, so slot
bookkeeping errors change outputs. Fast enough to try many configurations; the tiny-model tests are in
tests/scheduler/test_scheduler_on_a_tiny_model.py."""

import numpy as np
import pytest

from radixserve.config import ServerArgs
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.admission import IN_BATCH_PREFIX_MIN_TOKENS
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import OverlapStepLoop, SerialStepLoop, make_step_loop

CONTEXT_LEN = 512
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def make_loop(num_kv_slots=4096, tokenizer=None, **kw) -> SerialStepLoop:
    kw.setdefault("max_running_requests", 16)
    args = ServerArgs(device="cpu", **kw)
    scheduler = Scheduler(args, num_kv_slots, CONTEXT_LEN, [EOS], tokenizer)
    scheduler.check_invariant_every_step = True
    executor = FakeExecutor(num_kv_slots, args.max_running_requests, CONTEXT_LEN)
    return SerialStepLoop(scheduler, executor)


def greedy(max_new_tokens, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def prompts(n, seed=0):
    """Prompts sharing prefixes of various lengths, so the radix tree splits and reuses nodes."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(10, 1000, int(rng.integers(5, 60))).tolist() for _ in range(3)]
    return [
        roots[i % 3][: int(rng.integers(1, len(roots[i % 3]) + 1))] + rng.integers(10, 1000, 5).tolist()
        for i in range(n)
    ]


def run(loop, reqs) -> dict[str, Req]:
    for req in reqs:
        loop.scheduler.add_request(req)
    loop.run_until_idle()
    assert_idle(loop.scheduler)
    return {r.rid: r for r in reqs}


def assert_idle(s):
    s.check_invariant(walk_tree=True)
    assert not s.running and not s.waiting
    u = s.kv_usage()
    assert u["protected"] == u["owned"] == 0 and u["free"] + u["evictable"] == u["total"]


def reference(prompt_list, max_new=12) -> list[list[int]]:
    """One request at a time, no cache, no chunking."""
    out = []
    for i, p in enumerate(prompt_list):
        loop = make_loop(disable_radix_cache=True, chunked_prefill_size=-1, disable_mixed_batch=True)
        out.append(run(loop, [Req(f"r{i}", p, greedy(max_new))])[f"r{i}"].output_ids)
    return out


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(chunked_prefill_size=7),
        dict(disable_mixed_batch=True, chunked_prefill_size=5),
        dict(disable_radix_cache=True, chunked_prefill_size=7),
        dict(schedule_policy="fcfs"),
        dict(num_kv_slots=200, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01),
    ],
)
def test_outputs_do_not_depend_on_batching_caching_or_retraction(config):
    ps = prompts(30)
    loop = make_loop(**config)
    for _ in range(2):  # the second pass hits what the first left in the tree
        done = run(loop, [Req(f"r{i}", p, greedy(12)) for i, p in enumerate(ps)])
        assert [done[f"r{i}"].output_ids for i in range(len(ps))] == reference(ps)
    if "num_kv_slots" in config:
        assert loop.scheduler.stats.retractions > 0 and loop.scheduler.stats.evicted_tokens > 0


# The batching configurations that ran on the tiny model (25-33 s each), here on the fake executor through the
# overlapped loop that InProcessEngine runs; tests/scheduler/test_scheduler_on_a_tiny_model.py keeps the default one.
@pytest.mark.parametrize(
    "config",
    [
        dict(chunked_prefill_size=7),
        dict(chunked_prefill_size=-1),
        dict(disable_mixed_batch=True, chunked_prefill_size=7),
        dict(disable_radix_cache=True, chunked_prefill_size=7),
        dict(schedule_policy="fcfs"),
    ],
)
def test_overlapped_loop_outputs_do_not_depend_on_batching_or_a_warm_tree(config):
    ps = prompts(24, seed=4)
    expected = reference(ps)
    args = ServerArgs(device="cpu", max_running_requests=16, **config)
    scheduler = Scheduler(args, 4096, CONTEXT_LEN, [EOS], None)
    scheduler.check_invariant_every_step = True
    loop = make_step_loop(scheduler, FakeExecutor(4096, args.max_running_requests, CONTEXT_LEN))
    assert isinstance(loop, OverlapStepLoop)
    for attempt in ("cold", "warm"):  # the second pass hits the prefixes the first one left in the tree
        done = run(loop, [Req(f"{attempt}{i}", p, greedy(12)) for i, p in enumerate(ps)])
        assert [done[f"{attempt}{i}"].output_ids for i in range(len(ps))] == expected
    if not config.get("disable_radix_cache"):
        assert scheduler.stats.cached_prompt_tokens > 0


def test_shared_system_prompt_hits_the_cache(capsys):
    """Four system prompts of 300 tokens with eight questions each, sent at once: every question after a group's
    first finds its system prompt cached (but for a few tokens), and the radix cache computes under a third of the
    prefill tokens."""
    rng = np.random.default_rng(3)
    systems = [rng.integers(10, 1000, 300).tolist() for _ in range(4)]
    ps = [systems[g] + rng.integers(10, 1000, 20).tolist() for g in range(4) for _ in range(8)]
    computed = {}
    for name, kw in {"radix": {}, "no cache": {"disable_radix_cache": True}}.items():
        loop = make_loop(num_kv_slots=8192, max_running_requests=64, **kw)
        done = run(loop, [Req(f"r{i}", p, greedy(4)) for i, p in enumerate(ps)])
        computed[name] = loop.scheduler.stats.prefill_tokens_computed
        if name == "radix":
            for g in range(4):
                cached = [done[f"r{g * 8 + j}"].cached_tokens for j in range(1, 8)]
                # All of it, or all but the last few tokens of a chunk still being computed when the request was
                # admitted: fewer than IN_BATCH_PREFIX_MIN_TOKENS are not worth a step's wait (admission.py).
                assert all(c > 300 - IN_BATCH_PREFIX_MIN_TOKENS for c in cached), cached
    with capsys.disabled():
        print(
            f"\nshared system prompt, 32 requests: prefill tokens computed {computed['radix']} with the radix "
            f"cache vs {computed['no cache']} without"
        )
    assert computed["radix"] < computed["no cache"] / 3


@pytest.mark.parametrize("policy, first", [("lpm", "hit"), ("fcfs", "miss")])
def test_admission_order(policy, first):
    loop = make_loop(max_running_requests=1, schedule_policy=policy)
    s = loop.scheduler
    shared = list(range(100, 140))
    run(loop, [Req("warm", shared + [7], greedy(2))])
    miss, hit = Req("miss", list(range(500, 520)), greedy(2)), Req("hit", shared + [8], greedy(2))
    s.add_request(miss)
    s.add_request(hit)
    loop.step()
    assert [r.rid for r in s.running] == [first]
    assert hit.cached_tokens == (40 if first == "hit" else None)
    loop.run_until_idle()
    assert_idle(s)


def test_admission_reserves_room_for_running_requests_outputs():
    # 'long' will write 150 more tokens; admitting 'late' (60 tokens + 60 outputs) beside it would overrun the
    # 300-slot pool. With the whole reservation (ratio 1, no decay) it waits instead, and nothing is retracted.
    loop = make_loop(num_kv_slots=300, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    s = loop.scheduler
    long = Req("long", list(range(10, 110)), greedy(150))
    s.add_request(long)
    loop.step()
    late = Req("late", list(range(200, 260)), greedy(60))
    s.add_request(late)
    while long.status is ReqStatus.RUNNING:
        loop.step()
        assert late.status is ReqStatus.WAITING, f"admitted with {len(long.output_ids)} outputs of 150 done"
    loop.run_until_idle()
    assert late.finish_reason == long.finish_reason == "length" and s.stats.retractions == 0
    assert_idle(s)


def retracted_request(loop) -> Req:
    """Run two requests in a pool too small for both until one is retracted; return it."""
    s = loop.scheduler
    reqs = [Req(f"r{i}", list(range(10 + 50 * i, 40 + 50 * i)), greedy(60)) for i in range(2)]
    for r in reqs:
        s.add_request(r)
    for _ in range(200):
        loop.step()
        victims = [r for r in reqs if r.retractions and r.status is ReqStatus.WAITING]
        if victims:
            return victims[0]
    raise AssertionError("no retraction")


def test_retracted_request_resumes_with_the_same_tokens():
    loop = make_loop(num_kv_slots=100, init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    victim = retracted_request(loop)
    assert victim.output_ids and victim.kv_len == 0 and victim.req_pool_idx is None
    loop.run_until_idle()
    assert_idle(loop.scheduler)
    assert victim.finish_reason == "length"
    assert victim.output_ids == reference([victim.prompt_ids.tolist()], 60)[0]


def test_abort_of_a_retracted_request():
    loop = make_loop(num_kv_slots=100, init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    s = loop.scheduler
    victim = retracted_request(loop)
    assert s.abort(victim.rid)
    assert victim.finish_reason == "abort" and victim not in s.waiting
    s.check_invariant()
    outputs = loop.step()
    assert any(o.req is victim and o.finished for o in outputs)
    loop.run_until_idle()
    assert_idle(s)
    assert not s.abort(victim.rid)


def stop_string_case(tokenizer):
    """A prompt, its greedy outputs, and a stop string that straddles output tokens 3 and 4."""
    prompt = list(range(300, 320))
    outs = run(make_loop(), [Req("ref", prompt, greedy(20))])["ref"].output_ids
    left, right = tokenizer.decode(outs[3:4]), tokenizer.decode(outs[4:5])
    assert left and right
    # Ends inside token 4, starts inside token 3: only the text decoded after token 4 contains it.
    stop = left[-1:] + right[:1]
    full = tokenizer.decode(outs)
    first = full.find(stop)
    assert first >= len(tokenizer.decode(outs[:3])), "the test needs the stop string to appear first at token 3"
    return prompt, outs, stop


def test_stop_string_is_decided_by_the_scheduler(tokenizer):
    prompt, outs, stop = stop_string_case(tokenizer)
    loop = make_loop(tokenizer=tokenizer)
    req = Req("stop", prompt, greedy(20, stop=["never appears \u2603", stop]))
    run(loop, [req])
    assert req.finish_reason == "stop" and req.matched_stop == stop
    assert req.output_ids == outs[:5], "nothing may be generated past the token that completes the stop string"


def test_stop_string_output_message_and_kv_release(tokenizer):
    prompt, outs, stop = stop_string_case(tokenizer)
    loop = make_loop(tokenizer=tokenizer)
    s = loop.scheduler
    req = Req("stop", prompt, greedy(20, stop=[stop]))
    s.add_request(req)
    finished = [out.to_message() for out in loop.run_until_idle() if out.finished]
    (message,) = finished
    assert message.finish_reason == "stop" and message.matched_stop == stop and message.completion_tokens == 5
    assert not s.running and s.kv_usage()["owned"] == 0
    assert_idle(s)


def test_stop_strings_respect_min_new_tokens_and_ignore_the_prompt(tokenizer):
    prompt, outs, stop = stop_string_case(tokenizer)
    loop = make_loop(tokenizer=tokenizer)
    late = Req("late", prompt, greedy(20, stop=[stop], min_new_tokens=8))
    in_prompt = Req("prompt", prompt, greedy(6, stop=[tokenizer.decode(prompt[5:7])]))
    run(loop, [late, in_prompt])
    assert late.output_ids[:5] == outs[:5] and len(late.output_ids) > 5
    text = tokenizer.decode(late.output_ids)
    if late.finish_reason == "stop":  # only a later occurrence, completed at or after token 8, may stop it
        assert len(late.output_ids) >= 8 and text.count(stop) >= 2 and late.matched_stop == stop
    assert in_prompt.finish_reason == "length" and in_prompt.output_ids == outs[:6]


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="tokenizer"):
        make_loop().scheduler.add_request(Req("x", [10, 11], greedy(4, stop=["a"])))


def test_idle_check_walks_the_radix_tree():
    """The scheduler process audits the whole tree at idle (check_invariant(walk_tree=True)); the cheap per-step
    check only counts slots, so a tree whose own bookkeeping drifted passes it but not the walk."""
    from scheduler_service.scheduler import KVInvariantError

    loop = make_loop()
    run(loop, [Req("a", list(range(10, 50)), greedy(4))])
    tree = loop.scheduler.tree
    leaf = next(iter(tree.root.children.values()))
    leaf.lock_ref = -1  # corrupt a node without touching the size counters
    loop.scheduler.check_invariant()
    with pytest.raises(KVInvariantError, match="radix tree"):
        loop.scheduler.check_invariant(walk_tree=True)


def test_a_burst_over_one_cached_prompt_sends_its_slots_once():
    """Requests admitted together over the same cached prefix: the batch carries that prefix's slots once, the other
    requests refer to it (ReusedSlots.source), and every request's req_to_token row still gets them (the fake
    executor reads its context through them)."""
    from radixserve.config import ServerArgs
    from radixserve.sampling import SamplingParams
    from scheduler_service.fake_executor import FakeExecutor
    from scheduler_service.request import Req
    from scheduler_service.scheduler import Scheduler
    from scheduler_service.step_loop import make_step_loop

    args = ServerArgs(device="cpu", max_running_requests=32)
    scheduler = Scheduler(args, 8192, 4096, [2])
    scheduler.check_invariant_every_step = True
    loop = make_step_loop(scheduler, FakeExecutor(8192, 32, 4096, 1000))
    system = list(range(100, 400))
    one = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    scheduler.add_request(Req("warm", system + [5], one))
    loop.run_until_idle()
    for i in range(16):
        scheduler.add_request(Req(f"r{i}", system + [10 + i, 11 + i], one))
    scheduler_batch = scheduler.schedule()
    reused = scheduler_batch.batch.reused_slots
    assert len(reused) == 16 and sum(r.source < 0 for r in reused) == 1
    assert all(r.slots == b"" and reused[r.source].slots for r in reused if r.source >= 0)
    loop.executor.launch(scheduler_batch.batch)
    scheduler.process_results(scheduler_batch, loop.executor.collect())
    loop.run_until_idle()
    scheduler.check_invariant(walk_tree=True)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_finished_request_leaves_its_whole_sequence_in_the_tree(overlap, salt):
    """Prompt and outputs (less the last token, which has no KV) go into the tree under the request's own namespace
    and with its own slots, chunk by chunk as computed and the rest when it finishes: a next turn that resends them
    finds all of them cached, and its outputs are those of a cold run (the fake executor reads every slot)."""
    loop = make_loop(chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    first = Req("turn1", prompts(1, seed=5)[0] + list(range(300, 340)), greedy(9))
    first.cache_salt = salt
    run(loop, [first])
    s = loop.scheduler
    sequence = np.concatenate([first.prompt_ids, first.output_ids[:-1]])
    assert len(s.tree.match_prefix(sequence, namespace=salt).slots) == len(sequence)
    assert len(s.tree.match_prefix(sequence, namespace="other" if salt is None else None).slots) == 0
    follow_up = sequence.tolist() + [first.output_ids[-1], 77, 78]
    second = Req("turn2", follow_up, greedy(6))
    second.cache_salt = salt
    run(loop, [second])
    assert second.cached_tokens == len(sequence)
    cold = run(make_loop(disable_overlap_schedule=not overlap), [Req("cold", follow_up, greedy(6))])["cold"]
    assert second.output_ids == cold.output_ids
