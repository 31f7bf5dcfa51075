"""--api-server-count's default (radixserve/runtime/front_ends.py default_count): one front end per 2 usable CPUs on a
GPU, at most 8, and one on the CPU device, whose model bounds every step."""

import os

import pytest

from radixserve.runtime import front_ends


@pytest.mark.parametrize(("cpus", "count"), [(1, 1), (2, 1), (3, 1), (4, 2), (9, 4), (16, 8), (128, 8)])
def test_a_gpu_server_takes_one_front_end_per_two_cpus_up_to_eight(monkeypatch, cpus, count):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert front_ends.default_count("cuda") == count


def test_a_cpu_server_takes_one_front_end_whatever_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert front_ends.default_count("cpu") == 1
