"""GPU timing helpers shared by the kernel benches: the copy-bandwidth ceiling, CUDA-graph replay times, and each
kernel's device time from the profiler (graph replays included)."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus bytes written: the ceiling a
    memory-bound kernel is measured against (METHOD.md)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)  # random, never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph after `warmup` eager runs (Triton compiles and allocations settle outside)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median seconds of one replay (each timed alone with events, after two untimed replays)."""
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def kernel_times(run, iters: int = 10) -> dict[str, tuple[float, float]]:
    """{kernel name: (mean device seconds per call, calls per run)} over `iters` calls of run (a graph's replay or
    an eager step), from the torch profiler."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if total and evt.count and not evt.key.startswith(("cuda", "Activity")):
            out[evt.key] = (total / evt.count * 1e-6, evt.count / iters)
    return out


def launched_kernels(run) -> list[str]:
    """The names of the device kernels (and copies, fills) one call of run launches, in launch order."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]
