"""An optional torch.profiler window over a worker's steps, to see where a step's time goes on a real server.

RADIXSERVE_PROFILE_DIR=DIR turns it on: steps [RADIXSERVE_PROFILE_SKIP, +RADIXSERVE_PROFILE_STEPS) of each rank
are profiled (defaults 50 and 30), and a table of ops by CPU and by GPU time is written to DIR/rank<N>.txt.
With RADIXSERVE_PROFILE_TRIGGER=1 the window starts instead at the first step after the file DIR/start appears (a
benchmark creates it when the phase it wants to see begins). On a GPU, DIR/rank<N>.json gets the share of the
window's time during which the device ran a kernel or a copy (gpu_busy): 1.0 means the host never kept it waiting."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, rank: int):
        directory = os.environ.get("RADIXSERVE_PROFILE_DIR")
        self.path = Path(directory) / f"rank{rank}.txt" if directory else None
        self.skip = int(os.environ.get("RADIXSERVE_PROFILE_SKIP", "50"))
        self.trigger = (
            self.path.parent / "start" if self.path and os.environ.get("RADIXSERVE_PROFILE_TRIGGER") else None
        )
        self.count = int(os.environ.get("RADIXSERVE_PROFILE_STEPS", "30"))
        self.steps = 0
        self.profiler = None
        self.started = 0.0

    def step(self) -> None:
        """Call after each forward step."""
        if self.path is None:
            return
        self.steps += 1
        if self.trigger is not None and self.profiler is None:
            if not self.trigger.exists():
                return
            self.trigger.unlink(missing_ok=True)
            self.skip = self.steps
        if self.steps == self.skip:
            # Tracing every host op slows the host down; a window opened by a trigger measures the device's busy
            # share, which that would lower, so it traces the device alone.
            activities = [] if self.trigger is not None else [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()
        elif self.steps == self.skip + self.count and self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(f"{self.count} steps in {wall * 1e3:.1f} ms wall ({wall * 1e3 / self.count:.2f} ms/step)\n\n")
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=25) + "\n\n")
                if torch.cuda.is_available():
                    f.write(averages.table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
                busy = gpu_busy_share(self.profiler.events())
                self.path.with_suffix(".json").write_text(json.dumps({"steps": self.count, "gpu_busy": busy}))
            logger.info("wrote profile of %d steps to %s", self.count, self.path)
            self.profiler = None
            if self.trigger is not None:
                self.skip = -1  # until the trigger appears again


def gpu_busy_share(events) -> float:
    """The union of the device's kernel and copy intervals over the span from the first to the last of them."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return 0.0
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start = s
        end = max(end, e)
    busy += end - start
    return busy / (spans[-1][1] - spans[0][0]) if spans[-1][1] > spans[0][0] else 1.0
