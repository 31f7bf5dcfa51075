"""Decode batches advanced as arrays (scheduler_service/decode_batch.py) against batches rebuilt from every request
(--disable-incremental-decode-batch): the same batches go to the executor, byte for byte, and every request gets the
same tokens, finish, output messages and KV accounting, with the overlapped and the serial loop, in the scheduler
scenarios (cache on/off, chunking, mixed or not, shared-prefix groups, a full queue behind full rows, retraction,
aborts in flight, EOS, stop token ids, min_new_tokens, stop strings, max_tokens)."""

import numpy as np
import pytest

from radixserve.config import ServerArgs
from radixserve.protocol import unpack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import make_step_loop

CONTEXT_LEN = 256
EOS_IDS = list(range(10, 30))  # ids the fake executor samples (about 2% of them): some requests end on EOS


def make_loop(overlap: bool, incremental: bool, num_kv_slots=4096, tokenizer=None, vocab_size=1000, **kw):
    kw.setdefault("max_running_requests", 16)
    # Shared-prefix attention is on by default, so the grouped decodes' arrays are compared too.
    args = ServerArgs(
        device="cpu", disable_overlap_schedule=not overlap, disable_incremental_decode_batch=not incremental, **kw
    )
    scheduler = Scheduler(args, num_kv_slots, CONTEXT_LEN, EOS_IDS, tokenizer)
    scheduler.check_invariant_every_step = True
    return make_step_loop(scheduler, FakeExecutor(num_kv_slots, args.max_running_requests, CONTEXT_LEN, vocab_size))


def make_requests(n=24, seed=0, **params):
    """Shared prompt roots (cache hits, prefix groups); long and short outputs; a third stop on a token id (some only
    after min_new_tokens); EOS ends some of the others."""
    rng = np.random.default_rng(seed)
    ignore_eos = params.pop("ignore_eos", None)
    roots = [rng.integers(30, 1000, int(rng.integers(20, 60))).tolist() for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = roots[i % 3][: int(rng.integers(10, len(roots[i % 3]) + 1))] + rng.integers(30, 1000, 4).tolist()
        extra = (
            dict(stop_token_ids=[int(t) for t in rng.integers(30, 1000, 40)], min_new_tokens=int(rng.integers(0, 6)))
            if i % 3 == 0
            else {}
        )
        reqs.append(
            Req(
                f"r{i}",
                prompt,
                SamplingParams(
                    temperature=0.0,
                    max_new_tokens=int(rng.integers(1, 50)),
                    ignore_eos=i % 4 == 1 if ignore_eos is None else ignore_eos,
                    **extra,
                    **params,
                ),
            )
        )
    return reqs


def run(loop, reqs, abort_when=None, arrive_every=0):
    """Everything observable: per request its outputs, finish and every output message (queue_time, a wall-clock
    figure, left out), then the stats and every batch the executor got. arrive_every: the requests after the first
    four arrive one every that many steps (into a steady batch of decodes)."""
    s = loop.scheduler
    arriving = list(reqs[4:]) if arrive_every else []
    for req in reqs[:4] if arrive_every else reqs:
        s.add_request(req)
    messages = {r.rid: [] for r in reqs}
    by_rid = {r.rid: r for r in reqs}
    while loop.has_work() or arriving:
        if arriving and s.step_count % arrive_every == 0:
            s.add_request(arriving.pop(0))
        for rid, when in (abort_when or {}).items():
            delivered = [t for m in messages[rid] for t in unpack_i32(m[0])]
            if rid in s.requests and when(by_rid[rid], delivered):
                assert s.abort(rid)
        for out in loop.step():
            m = out.to_message()
            messages[out.req.rid].append(
                (
                    m.token_ids,
                    m.logprobs,
                    m.finished,
                    m.finish_reason,
                    m.matched_stop,
                    m.error,
                    m.prompt_tokens,
                    m.completion_tokens,
                    m.cached_tokens,
                )
            )
        assert s.stats.steps < 5_000
    s.check_invariant(walk_tree=True)
    assert not s.running and not s.waiting and all(r.status is ReqStatus.FINISHED for r in reqs)
    u = s.kv_usage()
    assert u["protected"] == u["owned"] == 0 and u["free"] + u["evictable"] == u["total"]
    stats = dict(vars(s.stats))
    incremental = stats.pop("incremental_decode_steps")
    outputs = {r.rid: (r.output_ids, r.finish_reason, r.matched_stop, messages[r.rid]) for r in reqs}
    return outputs, stats, loop.executor.batches, incremental


def assert_same_with_and_without(overlap, config, make, **run_kw):
    reference = run(make_loop(overlap, False, **config), make(), **run_kw)
    got = run(make_loop(overlap, True, **config), make(), **run_kw)
    assert reference[3] == 0
    assert got[3] > 0, "no step was built from the arrays"
    assert got[0] == reference[0]
    assert got[1] == reference[1]
    assert len(got[2]) == len(reference[2])
    for ours, theirs in zip(got[2], reference[2]):
        assert ours == theirs, f"step {theirs.step}: the batches differ"
    return got


CONFIGS = {
    "default": dict(),
    "groups": dict(shared_prefix_min_tokens=8),
    "chunked": dict(chunked_prefill_size=7),
    "unmixed": dict(disable_mixed_batch=True, chunked_prefill_size=16),
    "no_cache": dict(disable_radix_cache=True),
    "full_rows": dict(max_running_requests=3, schedule_policy="fcfs"),
    "retraction": dict(num_kv_slots=300, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("config", CONFIGS)
def test_same_batches_and_outputs_with_and_without_arrays(config, overlap):
    outputs, stats, _, _ = assert_same_with_and_without(overlap, CONFIGS[config], make_requests)
    reasons = {reason for _, reason, _, _ in outputs.values()}
    assert reasons == {"stop", "length"}, "stops (EOS, stop ids) and max_tokens both occur"
    if config == "retraction":
        assert stats["retractions"] > 0
    if config == "groups":
        assert stats["grouped_decodes"] > 0


def test_requests_arriving_while_others_decode():
    for overlap in (True, False):
        assert_same_with_and_without(overlap, {}, lambda: make_requests(12, seed=3), arrive_every=3)


def test_aborts_while_decoding():
    def mid_decode(req, delivered):
        return len(delivered) >= 5

    for overlap in (True, False):
        outputs = assert_same_with_and_without(
            overlap,
            {},
            lambda: make_requests(12, seed=1, ignore_eos=True),
            abort_when={"r2": mid_decode, "r7": mid_decode},
        )[0]
        assert outputs["r2"][1] == outputs["r7"][1] == "abort"


def test_stop_strings():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    config = dict(tokenizer=tokenizer, vocab_size=2000)
    reference = run(make_loop(False, False, **config), make_requests(12, seed=2, ignore_eos=True))[0]
    # Stop at a piece of text some outputs contain: the scheduler decides it, one token late would show.
    stops = sorted({tokenizer.decode(out[3:5])[:3] for out, _, _, _ in reference.values() if len(out) > 6})[:4]
    for overlap in (True, False):
        outputs = assert_same_with_and_without(
            overlap, config, lambda: make_requests(12, seed=2, ignore_eos=True, stop=stops)
        )[0]
        assert any(isinstance(matched, str) for _, _, matched, _ in outputs.values())


def test_output_messages_are_the_keyword_built_ones():
    """StepOutput.to_message and the decode path build RequestOutput positionally (for speed): that must keep meaning
    the same fields, whatever is added to RequestOutput later."""
    from radixserve.protocol import RequestOutput
    from scheduler_service.step_output import StepOutput

    req = Req("r", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
    req.output_ids, req.cached_tokens, req.finish_reason, req.matched_stop = [40, 41], 2, "stop", 41
    message = StepOutput(req, [41], [], True, 2).to_message()
    assert message == RequestOutput(
        rid="r",
        token_ids=np.asarray([41], dtype=np.int32).tobytes(),
        logprobs=[],
        finished=True,
        finish_reason="stop",
        matched_stop=41,
        error=None,
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=2,
        queue_time=None,
    )
    # The decode path's own messages: the same as to_message's for every request that goes on.
    loop = make_loop(True, True)
    s = loop.scheduler
    for req in make_requests(6, seed=4, ignore_eos=True):
        s.add_request(req)
    checked = 0
    while loop.has_work():
        for out in loop.step():
            if out.message is not None and not out.finished:
                built, out.message = out.message, None
                assert built == out.to_message()
                checked += 1
    assert checked > 0
