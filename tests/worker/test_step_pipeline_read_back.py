"""StepPipeline.finish_before (--read-back-wait-ms): between two long host steps the step in flight is read back
before the next is launched, never before a decode-graph replay, and never past the wait. The runner here records
the calls in order and stands for the model: what is tested is the pipeline's ordering; the real worker's tokens
with the wait on are checked end to end in tests/e2e/test_engine.py."""

from radixserve.protocol import ForwardBatch, SampledTokens
from radixserve.worker.step_pipeline import StepPipeline


def _batch(step: int, decode_graph: bool) -> ForwardBatch:
    return ForwardBatch(step, b"", b"", b"\x01" if decode_graph else b"\x07", b"", b"", b"")


class _Step:
    def __init__(self, step: int, ready: bool):
        self.step, self._ready = step, ready

    def ready(self) -> bool:
        return self._ready


class RecordingRunner:
    def __init__(self):
        self.calls = []
        self.ready = True  # whether a sampled step's tokens are on the host

    def replays_decode_graph(self, batch):
        return batch.extend_lens == b"\x01"

    def compute_logits(self, batch):
        self.calls.append(("forward", batch.step))
        return batch.step

    def sample(self, batch, logits):
        self.calls.append(("sample", batch.step))
        return _Step(batch.step, self.ready)

    def finish_step(self, step):
        self.calls.append(("read back", step.step))
        return SampledTokens(step=step.step, token_ids=b"")


def test_long_step_after_long_step_reads_the_first_back_before_launching():
    runner = RecordingRunner()
    pipeline = StepPipeline(runner, read_back_wait_s=0.01)
    assert pipeline.finish_before(_batch(0, decode_graph=False)) is None  # nothing in flight
    assert pipeline.launch(_batch(0, decode_graph=False)) is None
    early = pipeline.finish_before(_batch(1, decode_graph=False))
    assert early.step == 0
    assert pipeline.launch(_batch(1, decode_graph=False)) is None  # already reported
    assert runner.calls == [("forward", 0), ("sample", 0), ("read back", 0), ("forward", 1), ("sample", 1)]


def test_decode_graph_steps_keep_the_pipelined_order():
    runner = RecordingRunner()
    pipeline = StepPipeline(runner, read_back_wait_s=0.01)
    pipeline.launch(_batch(0, decode_graph=False))
    assert pipeline.finish_before(_batch(1, decode_graph=True)) is None  # before a replay: never
    assert pipeline.launch(_batch(1, decode_graph=True)).step == 0
    assert pipeline.finish_before(_batch(2, decode_graph=False)) is None  # after a replay: the device trails
    assert pipeline.launch(_batch(2, decode_graph=False)).step == 1
    assert runner.calls == [
        ("forward", 0),
        ("sample", 0),
        ("forward", 1),
        ("read back", 0),
        ("sample", 1),
        ("forward", 2),
        ("read back", 1),
        ("sample", 2),
    ]


def test_wait_is_bounded_and_zero_turns_it_off():
    runner = RecordingRunner()
    runner.ready = False  # the step in flight's tokens never arrive within the wait
    pipeline = StepPipeline(runner, read_back_wait_s=0.002)
    pipeline.launch(_batch(0, decode_graph=False))
    assert pipeline.finish_before(_batch(1, decode_graph=False)) is None
    assert pipeline.in_flight is not None  # still in flight: launch reads it back after queuing the next forward
    runner.ready = True
    off = StepPipeline(runner, read_back_wait_s=0.0)
    off.launch(_batch(0, decode_graph=False))
    assert off.finish_before(_batch(1, decode_graph=False)) is None
