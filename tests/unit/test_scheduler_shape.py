"""The scheduler's shape (docs/architecture.md, "The scheduler's components"): a Scheduler without mixins, whose
components are given what they work on rather than the scheduler, in modules a reader can take in whole."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from radixserve.config import ServerArgs
from scheduler_service.admission import Admission
from scheduler_service.batch_builder import BatchBuilder
from scheduler_service.endings import Endings
from scheduler_service.long_context import LongContext
from scheduler_service.memory_pressure import MemoryPressure
from scheduler_service.results import ResultProcessor
from scheduler_service.scheduler import Scheduler

COMPONENTS = [Admission, MemoryPressure, BatchBuilder, ResultProcessor, Endings, LongContext]
SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "scheduler_service"


def test_the_scheduler_has_no_mixins():
    assert Scheduler.__bases__ == (object,)


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.__name__)
def test_a_component_is_given_its_inputs_not_the_scheduler(component):
    params = set(inspect.signature(component.__init__).parameters)
    assert not params & {"scheduler", "s", "owner", "parent"}, params
    source = inspect.getsource(inspect.getmodule(component))
    assert "scheduler_service.scheduler import" not in source


def test_the_scheduler_builds_every_component():
    s = Scheduler(ServerArgs(device="cpu"), num_kv_slots=64, context_len=64, eos_token_ids=[0])
    built = {type(value) for value in vars(s).values()}
    assert set(COMPONENTS) - {LongContext} <= built


@pytest.mark.parametrize("path", sorted(SCHEDULER_DIR.glob("*.py")), ids=lambda p: p.name)
def test_scheduler_modules_stay_under_400_lines(path):
    assert len(path.read_text().splitlines()) < 400
