"""An optional torch.profiler window over a worker's steps, to see where a step's time goes on a real server.

RADIXSERVE_PROFILE_DIR=DIR turns it on: steps [RADIXSERVE_PROFILE_SKIP, +RADIXSERVE_PROFILE_STEPS) of each rank
are profiled (defaults 50 and 30), and a table of ops by CPU and by GPU time is written to DIR/rank<N>.txt."""

from __future__ import annotations

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
        self.count = int(os.environ.get("RADIXSERVE_PROFILE_STEPS", "30"))
        self.steps = 0
        self.profiler = None
        self.started = 0.0

    def step(self) -> None:
        """Call after each forward step."""
        if self.path is None:
            return
        self.steps += 1
        if self.steps == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
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
            logger.info("wrote profile of %d steps to %s", self.count, self.path)
            self.profiler = None
