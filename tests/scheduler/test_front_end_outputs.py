"""Several HTTP front ends (--api-server-count): each request's outputs go back to the front end that sent it, one
BatchOutput per front end per step (scheduler_service/step_output.py per_front_end, as SchedulerProcess sends them),
and the DP controller passes the front end's index through to the replicas and their answers back to that front end
(real ZeroMQ sockets in this process, the replicas played by the test). Through real processes:
tests/e2e/test_api_servers.py."""

from __future__ import annotations

import shutil

import msgspec
import pytest
import zmq

from radixserve.config import ServerArgs
from radixserve.protocol import (
    BatchOutput,
    CacheStats,
    CacheStatsRequest,
    FlushCacheRequest,
    FlushCacheResult,
    ListPinsRequest,
    PinEntry,
    PinPrefixRequest,
    PinsReply,
    SchedulerLoad,
    SchedulerToTokenizer,
    ServerInfo,
    ServerInfoRequest,
    TokenizedRequest,
    TokenizerToScheduler,
    UnpinPrefixRequest,
    pack_i32,
)
from radixserve.runtime.data_parallel import replica_endpoints
from radixserve.runtime.ipc import Channel, Endpoints, make_ipc_dir
from radixserve.sampling import SamplingParams
from scheduler_service.dp_controller import DataParallelController
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import make_step_loop
from scheduler_service.step_output import StepOutput, per_front_end

POOL, CONTEXT_LEN = 600, 512


def request(rid: str, front_end: int, first: int) -> Req:
    req = Req(rid, [first, 21, 22, 23, 24], SamplingParams(max_new_tokens=3, ignore_eos=True))
    req.front_end = front_end
    return req


def test_each_front_end_gets_one_message_a_step_with_only_its_requests():
    args = ServerArgs(device="cpu", max_running_requests=16)
    scheduler = Scheduler(args, POOL, CONTEXT_LEN, [2])
    loop = make_step_loop(scheduler, FakeExecutor(POOL, args.max_running_requests, CONTEXT_LEN))
    senders = {"a": 0, "b": 2, "c": 0, "d": 2, "e": 2}  # front end 1 sent nothing
    for i, (rid, front_end) in enumerate(senders.items()):
        scheduler.add_request(request(rid, front_end, 100 + i))
    steps = 0
    while loop.has_work():
        outputs = loop.step()
        batches = per_front_end(outputs, 3)
        # One message per front end that has outputs this step; in the step's order within it.
        assert [i for i, _ in batches] == sorted({senders[o.req.rid] for o in outputs})
        for i, batch in batches:
            assert [m.rid for m in batch] == [o.req.rid for o in outputs if senders[o.req.rid] == i]
        assert sum(len(batch) for _, batch in batches) == len(outputs)
        steps += bool(outputs)
    assert steps >= 3
    assert per_front_end([], 3) == []


def test_one_front_end_takes_every_output_without_a_look_at_the_requests():
    outputs = [StepOutput(request(rid, 5, 100), [7]) for rid in ("a", "b")]  # an index that one front end ignores
    [(index, batch)] = per_front_end(outputs, 1)
    assert index == 0 and [m.rid for m in batch] == ["a", "b"]


def test_front_end_index_defaults_to_zero_and_travels():
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.Decoder(TokenizerToScheduler).decode
    plain = TokenizedRequest("r", pack_i32([1, 2]), SamplingParams(), 0.0)  # Engine's and Dynamo's: front end 0
    assert plain.front_end == 0 and decode(encode(plain)).front_end == 0
    for message in (
        TokenizedRequest("r", pack_i32([1]), SamplingParams(), 0.0, priority=1, front_end=3),
        ServerInfoRequest("q", front_end=3),
        UnpinPrefixRequest("q", "pin-1", front_end=3),
    ):
        assert decode(encode(message)) == message


# ------------------------------------------------------------------------------------------ the DP controller


@pytest.fixture
def dp_sockets():
    """A DP controller of 2 replicas behind 2 front ends, and the test's ends of every socket around it."""
    endpoints = Endpoints(make_ipc_dir())
    ctx = zmq.Context()
    controller = DataParallelController(ServerArgs(device="cpu", dp_size=2, api_server_count=2), endpoints)
    fronts = [
        Channel(ctx, zmq.PULL, endpoints.scheduler_to_front_end(k), bind=True, recv_type=SchedulerToTokenizer)
        for k in range(2)
    ]
    to_controller = Channel(ctx, zmq.PUSH, endpoints.tokenizer_to_scheduler, bind=False)
    replicas = [replica_endpoints(endpoints, i) for i in range(2)]
    replica_in = [
        Channel(ctx, zmq.PULL, ep.tokenizer_to_scheduler, bind=True, recv_type=TokenizerToScheduler) for ep in replicas
    ]
    replica_out = [
        [Channel(ctx, zmq.PUSH, ep.scheduler_to_front_end(k), bind=False) for k in range(2)] for ep in replicas
    ]
    try:
        yield controller, fronts, to_controller, replica_in, replica_out
    finally:
        for channel in [*fronts, to_controller, *replica_in, *(c for out in replica_out for c in out)]:
            channel.close()
        ctx.term()
        shutil.rmtree(endpoints.ipc_dir, ignore_errors=True)


def test_dp_controller_answers_the_front_end_that_asked(dp_sockets):
    controller, fronts, to_controller, replica_in, replica_out = dp_sockets

    def at_replicas(n: int) -> list[tuple[int, object]]:
        """The next n messages the replicas get, as (replica, message), moving the controller on meanwhile."""
        got = []
        for _ in range(50):
            controller.poll(100)
            got += [(i, m) for i, ch in enumerate(replica_in) for m in iter(ch.recv_nowait, None)]
            if len(got) >= n:
                return got
        raise AssertionError(f"the replicas got {got}, expected {n} messages")

    def at_front(k: int):
        for _ in range(50):
            controller.poll(100)
            message = fronts[k].recv_nowait()
            if message is not None:
                assert fronts[1 - k].recv(timeout_ms=50) is None, "the other front end got an answer too"
                return message
        raise AssertionError(f"front end {k} got nothing")

    # A request of front end 1: its outputs, sent by its replica on the socket to front end 1, reach front end 1 only.
    to_controller.send(TokenizedRequest("r1", pack_i32([5, 6, 7]), SamplingParams(), 0.0, front_end=1))
    [(i, sent)] = at_replicas(1)
    assert sent.front_end == 1
    load = SchedulerLoad(1, 0, 3, 0, 100)
    replica_out[i][1].send(BatchOutput([], load))
    assert isinstance(at_front(1), BatchOutput)

    # A question every replica answers: each answers front end 1's socket; one merged answer to front end 1.
    to_controller.send(ServerInfoRequest("q1", front_end=1))
    for i, message in at_replicas(2):
        assert message.front_end == 1
        replica_out[i][1].send(ServerInfo("q1", {"num_running": i + 1, "kv_invariant_ok": True}))
    info = at_front(1)
    assert isinstance(info, ServerInfo) and info.info["num_running"] == 3

    # The dashboard's numbers and a flush, the same way.
    for ask, answer in (
        (
            CacheStatsRequest("s1", front_end=1),
            lambda i: CacheStats("s1", {"prompt_tokens_computed": i, "prompt_tokens_cached": 1}),
        ),
        (FlushCacheRequest("f1", front_end=1), lambda i: FlushCacheResult("f1", True)),
    ):
        to_controller.send(ask)
        for i, message in at_replicas(2):
            replica_out[i][message.front_end].send(answer(i))
        assert type(at_front(1)) is type(answer(0))

    # A pin of front end 0, then its unpin by front end 1: the controller's own unpins to the replicas keep index 1.
    to_controller.send(PinPrefixRequest("p", pack_i32([1, 2, 3]), front_end=0))
    for i, message in at_replicas(2):
        assert message.front_end == 0
        replica_out[i][0].send(PinsReply("p", 200, pins=[PinEntry(f"pin-r{i}", None, 3, 1.0, None)]))
    pin_id = at_front(0).pins[0].id
    to_controller.send(UnpinPrefixRequest("u", pin_id, front_end=1))
    for i, message in at_replicas(2):
        assert message.front_end == 1 and message.pin_id == f"pin-r{i}"
        replica_out[i][1].send(PinsReply("u", 200, pins=[PinEntry(f"pin-r{i}", None, 3, 1.0, None)]))
    assert at_front(1).status == 200
    to_controller.send(ListPinsRequest("l", front_end=1))
    for i, message in at_replicas(2):
        replica_out[i][message.front_end].send(PinsReply("l", 200))
    assert at_front(1).pins == []
