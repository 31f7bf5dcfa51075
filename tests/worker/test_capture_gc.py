"""CUDA graph captures run with Python's cyclic garbage collector collected first and paused throughout
(radixserve/worker/cuda_graph.garbage_collected_and_paused), so that no collection inside a capture frees a dead
engine's graphs. Checked on the CPU: a dead cycle made before the block is gone when it starts, none made inside it
is collected before it ends, and the collector's state afterwards is the one it had before."""

import gc
import weakref

from radixserve.worker.cuda_graph import garbage_collected_and_paused


class Node:
    def __init__(self):
        self.self_ref = self  # a reference cycle: only the cyclic collector frees it


def dead_cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_a_dead_cycle_is_collected_before_the_block_and_none_inside_it():
    before = dead_cycle()
    with garbage_collected_and_paused():
        assert before() is None, "a cycle dead before the block survived into it"
        assert not gc.isenabled()
        inside = dead_cycle()
        for _ in range(3 * gc.get_threshold()[0]):  # allocations enough to trigger generation 0 several times
            Node()
        assert inside() is not None, "a collection ran inside the block"
    assert gc.isenabled()
    gc.collect()
    assert inside() is None


def test_the_collector_stays_off_after_the_block_when_it_was_off_before():
    gc.disable()
    try:
        with garbage_collected_and_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
