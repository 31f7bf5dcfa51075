"""The data-parallel controller process (--dp-size > 1), between the front end and the replicas' schedulers. It
takes the scheduler's place on the front end's sockets: each new request goes to the replica the router picks
(scheduler_service/dp_router.py), an abort to the replica running the request, /flush_cache, /server_info and
/v1/cache/stats to all of them (one merged answer), and the pin messages to all of them too: a pin is kept on every
replica (scheduler_service/dp_pins.py). Replies come back through here so that the router sees which requests
finished, and the replicas' cache events keep its mirrors of their trees exact; outputs are passed on with the
server's load (the sum of the replicas') in place of the replica's.

With --api-server-count N each replica's scheduler has N sockets back, one per front end, as without DP: the
controller binds every one of them and passes what arrives on replica i's socket k to front end k, so the index a
message carries (FromFrontEnd.front_end) reaches the replica unchanged and the answer finds its way back."""

from __future__ import annotations

import msgspec
import zmq

from radixserve.config import ServerArgs
from radixserve.runtime.data_parallel import replica_endpoints
from radixserve.runtime.ipc import Channel, Endpoints
from radixserve.runtime.process_util import run_child
from radixserve.protocol import KvBlockEvents
from radixserve.protocol import (
    AbortRequest,
    BatchOutput,
    CacheEvents,
    FlushCacheRequest,
    FlushCacheResult,
    ReplicaToController,
    SchedulerLoad,
    ServerInfo,
    ServerInfoRequest,
    TokenizedBatch,
    TokenizedRequest,
    TokenizerToScheduler,
    unpack_i32,
)
from radixserve.protocol import ListPinsRequest, PinPrefixRequest, PinsReply, UnpinPrefixRequest
from radixserve.protocol import CacheStats, CacheStatsRequest
from scheduler_service.cache_stats import merge_cache_numbers, merge_cache_stats
from scheduler_service.dp_pins import ReplicatedPins
from scheduler_service.dp_router import DataParallelRouter

SUMMED = (
    "num_running",
    "num_waiting",
    "kv_total",
    "kv_free",
    "kv_evictable",
    "kv_protected",
    "kv_owned",
    "steps",
    "prefill_tokens_computed",
    "cached_prompt_tokens",
    "retractions",
)
PER_REPLICA = (
    "num_running",
    "num_waiting",
    "kv_owned",
    "kv_protected",
    "prefill_tokens_computed",
    "cached_prompt_tokens",
    "kv_total",
    "kv_free",
    "kv_evictable",
    "kv_pinned",
    "num_pins",
    "kv_invariant_ok",
)
# The dashboard's numbers (/v1/cache/stats) also given per replica, as dp<i>_<name>.
PER_REPLICA_CACHE = (
    "num_running",
    "num_waiting",
    "kv_total",
    "kv_free",
    "kv_cached",
    "kv_in_use",
    "kv_pinned",
    "num_pins",
    "cache_hit_rate",
    "prompt_tokens_cached",
    "prompt_tokens_computed",
    "evicted_tokens",
)


class DataParallelController:
    def __init__(self, args: ServerArgs, endpoints: Endpoints):
        self.args = args
        ctx = zmq.Context()
        self.from_front = Channel(
            ctx, zmq.PULL, endpoints.tokenizer_to_scheduler, bind=True, recv_type=TokenizerToScheduler
        )
        fronts = range(args.api_server_count)
        self.to_front = [Channel(ctx, zmq.PUSH, endpoints.scheduler_to_front_end(k), bind=False) for k in fronts]
        replicas = [replica_endpoints(endpoints, i) for i in range(args.dp_size)]
        self.to_replicas = [Channel(ctx, zmq.PUSH, ep.tokenizer_to_scheduler, bind=False) for ep in replicas]
        # (replica, front end) of each socket from a replica; raw sockets, decoded here.
        self.from_replicas: list[tuple[int, int, zmq.Socket]] = []
        for i, ep in enumerate(replicas):
            for k in fronts:
                sock = ctx.socket(zmq.PULL)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.bind(ep.scheduler_to_front_end(k))
                self.from_replicas.append((i, k, sock))
        self.decode = msgspec.msgpack.Decoder(ReplicaToController).decode
        self.router = DataParallelRouter(args.dp_size, args.load_balance_method)
        self.replies: dict[str, dict[int, FlushCacheResult | ServerInfo]] = {}
        self.loads: list[SchedulerLoad | None] = [None] * args.dp_size
        self.pins = ReplicatedPins(args.dp_size)
        self.poller = zmq.Poller()
        for sock in [self.from_front.socket, *(sock for _, _, sock in self.from_replicas)]:
            self.poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        while True:
            self.poll()

    def poll(self, timeout_ms: int | None = None) -> None:
        """Wait for messages from the front ends or the replicas (at most timeout_ms), and pass on what came."""
        ready = dict(self.poller.poll(timeout_ms))
        for i, k, sock in self.from_replicas:
            if sock in ready:
                self._from_replica(i, k, sock)
        if self.from_front.socket in ready:
            message = self.from_front.recv_nowait()
            while message is not None:
                self._from_front(message)
                message = self.from_front.recv_nowait()

    def _from_front(self, message) -> None:
        if isinstance(message, TokenizedRequest):
            i = self.router.route(message.rid, unpack_i32(message.input_ids), message.dp_rank)
            self.to_replicas[i].send(message)
        elif isinstance(message, TokenizedBatch):  # routed one by one: each may go to its own replica
            for request in message.requests:
                self._from_front(request)
        elif isinstance(message, AbortRequest):
            owner = self.router.owner.get(message.rid)
            for i in [owner] if owner is not None else range(len(self.to_replicas)):
                self.to_replicas[i].send(message)
        elif isinstance(message, (PinPrefixRequest, ListPinsRequest, UnpinPrefixRequest)):
            self._pin_step(message.front_end, *self.pins.from_front(message))
        elif isinstance(message, (FlushCacheRequest, ServerInfoRequest, CacheStatsRequest)):
            self.replies[message.request_id] = {}
            for channel in self.to_replicas:
                channel.send(message)

    def _from_replica(self, i: int, k: int, sock: zmq.Socket) -> None:
        """What replica i sent on its socket to front end k."""
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decode(frame.buffer)
            if isinstance(message, BatchOutput):
                for out in message.outputs:
                    if out.finished:
                        self.router.finished(out.rid)
                # The front end's gauges (running, waiting, KV slots) are of the whole server: every replica's sum.
                self.loads[i] = message.load
                message.load = SchedulerLoad(
                    *(
                        sum(column)
                        for column in zip(
                            *(
                                (
                                    load.num_running,
                                    load.num_waiting,
                                    load.kv_slots_used,
                                    load.kv_slots_cached,
                                    load.kv_slots_total,
                                )
                                for load in self.loads
                                if load is not None
                            )
                        )
                    )
                )
                self.to_front[k].send(message)
            elif isinstance(message, CacheEvents):
                self.router.replicas[i].apply(message)
            elif isinstance(message, KvBlockEvents):  # for Dynamo's router, which routes to (worker, dp_rank)
                message.dp_rank = i
                self.to_front[k].send(message)
            elif isinstance(message, PinsReply):
                self._pin_step(k, *self.pins.from_replica(i, message))
            else:
                self._gather(i, k, message)

    def _pin_step(self, front_end: int, sends: list, reply: PinsReply | None) -> None:
        for i, message in sends:
            self.to_replicas[i].send(message)
        if reply is not None:
            self.to_front[front_end].send(reply)

    def _gather(self, i: int, front_end: int, reply: FlushCacheResult | ServerInfo | CacheStats) -> None:
        replies = self.replies.get(reply.request_id)
        if replies is None:
            return
        replies[i] = reply
        if len(replies) < len(self.to_replicas):
            return
        del self.replies[reply.request_id]
        ordered = [replies[k] for k in range(len(self.to_replicas))]
        if isinstance(reply, CacheStats):
            answer = merge_cache_stats(reply.request_id, ordered)
            for k, r in enumerate(ordered):
                answer.numbers.update({f"dp{k}_{key}": r.numbers.get(key) for key in PER_REPLICA_CACHE})
            answer.numbers["dp_size"] = len(ordered)
        elif isinstance(reply, FlushCacheResult):
            ok = all(r.success for r in ordered)
            why = "; ".join(f"replica {k}: {r.message}" for k, r in enumerate(ordered) if not r.success)
            answer = FlushCacheResult(reply.request_id, ok, why)
        else:
            answer = ServerInfo(reply.request_id, merge_server_info([r.info for r in ordered], self.args))
        self.to_front[front_end].send(answer)


def merge_server_info(infos: list[dict], args: ServerArgs) -> dict:
    """The first replica's settings, counters summed over replicas, a few per replica (dp<i>_...)."""
    merged = dict(infos[0])
    for key in SUMMED:
        if all(isinstance(info.get(key), (int, float)) for info in infos):
            merged[key] = sum(info[key] for info in infos)
    merged["kv_invariant_ok"] = all(info.get("kv_invariant_ok", True) for info in infos)
    if all("cache_hit_rate" in info for info in infos):
        merged.update(merge_cache_numbers(infos))  # the cache metrics (scheduler_service/cache_stats.py)
    # A request goes to one replica, any of them: it must fit the smallest pool.
    if all(isinstance(info.get("kv_pool_tokens"), int) for info in infos):
        merged["kv_pool_tokens"] = min(info["kv_pool_tokens"] for info in infos)
    for i, info in enumerate(infos):
        for key in PER_REPLICA:
            merged[f"dp{i}_{key}"] = info.get(key)
    merged["dp_size"] = args.dp_size
    merged["load_balance_method"] = args.load_balance_method
    return merged


def run_dp_controller(args: ServerArgs, model_dir: str, endpoints: Endpoints, on_ready) -> None:
    controller = DataParallelController(args, endpoints)
    on_ready({"dp_size": args.dp_size})
    controller.run()


if __name__ == "__main__":
    run_child("dp-controller", run_dp_controller)
