"""RequestGroup.stream (tokenizer_service/request_group.py): what was delivered while the handler was busy comes as
one batch, a delivery wakes a waiting handler, and the stream ends once every sequence has finished; plus the
per-token micro-benchmark of the HTTP process (bench/front_end_stream_bench.py) runs end to end."""

import asyncio

from radixserve.request_pipeline import SequenceOutput
from tokenizer_service.request_group import RequestGroup


class Manager:
    def abort_group(self, group) -> None:
        pass


def out(index: int, text: str, finished: bool = False) -> SequenceOutput:
    return SequenceOutput(index, text, [1], [], finished)


def test_batches_wakeups_and_the_end_of_a_stream():
    async def scenario():
        group = RequestGroup("r", Manager())
        group.add(object())  # two sequences (stream() counts them)
        group.add(object())
        group._unfinished = 2
        batches = []

        async def handler():
            async for batch in group.stream():
                batches.append([(o.index, o.text, o.finished) for o in batch])

        group.deliver(out(0, "a"))
        group.deliver(out(1, "b"))  # both before the handler runs: one batch
        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert batches == [[(0, "a", False), (1, "b", False)]]
        group.deliver(out(0, "c", finished=True))  # the handler waits: this wakes it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert batches[-1] == [(0, "c", True)] and not task.done()
        group.deliver(out(1, "d", finished=True))
        await asyncio.wait_for(task, 5)  # every sequence finished: the stream ends
        assert batches[-1] == [(1, "d", True)] and len(batches) == 3
        assert group.finished

    asyncio.run(scenario())


def test_front_end_stream_bench_runs():
    from bench.front_end_stream_bench import run_once
    from radixserve.testing import smollm2_dir
    from radixserve.tokenizer_loading import load_tokenizer

    seconds = asyncio.run(run_once(load_tokenizer(smollm2_dir()), 4, 3, 0))
    assert seconds > 0
