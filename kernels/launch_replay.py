"""One layer's attention launches replayed for the layers after it: the host work of an eager attention call is paid
once per step instead of once per layer (what FlashInfer's plan-once, run-per-layer split buys its wrappers).

Between the pieces of a prefill CUDA graph (radixserve/worker/prefill_cuda_graph.py) each layer's attention runs
eagerly, and every layer makes the same Triton launches: the step's layout is the same, the q/k/v/o buffers are the
pieces' static ones, and only the layer's K/V cache differs. A Triton launch from Python costs ~45-70 us of host
time (binding ~45 arguments, specialising each, looking the binary up), so a mixed step's attention took ~250 us of
host time a layer, 7 of a step's 9 ms on an H200 at 80 requests/s, with the device waiting; replayed, a launch costs
~15 us (bench/results/mixed-step-host-h200.md).

A LaunchRecording watches the first layer's launches made through `recordable(kernel)[grid](...)`: each launch's
compiled binary (the one Triton chose for those arguments), its grid and its arguments. replay() launches the same
binaries with the same arguments, the layer's caches put where the first layer's were. That is exact: a cache of the
same shape, dtype, strides and alignment (the caller checks: prefill_cuda_graph._attention_layout) gets the binary
Triton would have chosen, and every other argument is the one the first layer passed (its scratch buffers are
reused: the stream runs the layers' launches one after another).

A recording refuses to replay (replayable False, and the caller launches each layer as before) when it cannot
vouch for that: a Triton launch that did not go through recordable() (counted by Triton's launch hook), an argument
that views a cache other than the cache itself, or a Triton without compiled binaries (the interpreter).
kernels.OPTIONS["attention_launch_replay"] turns it off.
"""

from __future__ import annotations

import contextlib

import torch

try:  # the launch hook counts every Triton launch while a layer is recorded
    from triton import knobs as _knobs
except ImportError:  # an older Triton: no count, so nothing is replayed
    _knobs = None

_active: LaunchRecording | None = None


class _Launch:
    __slots__ = ("runner", "args", "k_positions", "v_positions")

    def __init__(self, runner, args, k_positions, v_positions):
        self.runner, self.args, self.k_positions, self.v_positions = runner, args, k_positions, v_positions


class LaunchRecording:
    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.k_cache, self.v_cache = k_cache, v_cache
        self._cache_storages = (k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr())
        self.launches: list[_Launch] = []
        self.replayable = _knobs is not None
        self._hook_launches = 0

    def add(self, kernel, compiled, grid, args, kwargs) -> None:
        """One launch: kernel[grid](*args, **kwargs) returned `compiled`."""
        if compiled is None or not hasattr(compiled, "__getitem__") or callable(grid):  # the interpreter: no binary
            self.replayable = False
            return
        params = kernel.signature.parameters
        names = list(params)
        values = list(args) + [kwargs[n] if n in kwargs else params[n].default for n in names[len(args) :]]
        for value in values:
            if isinstance(value, torch.Tensor) and value is not self.k_cache and value is not self.v_cache:
                if value.untyped_storage().data_ptr() in self._cache_storages:
                    self.replayable = False  # a view of a cache: replay could not put the layer's own in its place
        grid = tuple(grid) + (1,) * (3 - len(grid))
        k_positions = [i for i, value in enumerate(values) if value is self.k_cache]
        v_positions = [i for i, value in enumerate(values) if value is self.v_cache]
        self.launches.append(_Launch(compiled[grid], values, k_positions, v_positions))

    def replay(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The recorded launches again, over this layer's caches (same shape, dtype and strides as the first's)."""
        assert self.replayable
        for launch in self.launches:
            args = list(launch.args)
            for i in launch.k_positions:
                args[i] = k_cache
            for i in launch.v_positions:
                args[i] = v_cache
            launch.runner(*args)

    def _count_hook(self, *_):
        self._hook_launches += 1


def _count_launches(hook):
    """Adds hook to Triton's launch-enter hooks; returns what removes it, or None where launches cannot be counted
    (no hook API, or another's single hook in the place)."""
    if _knobs is None:
        return None
    hooks = _knobs.runtime.launch_enter_hook
    if hasattr(hooks, "add"):  # a chain of hooks (Triton 3.4 and later)
        hooks.add(hook)
        return lambda: hooks.remove(hook)
    if hooks is None:
        _knobs.runtime.launch_enter_hook = hook
        return lambda: setattr(_knobs.runtime, "launch_enter_hook", None)
    return None


@contextlib.contextmanager
def recording(rec: LaunchRecording | None):
    """Records the launches made through recordable() inside the block into rec (None: records nothing)."""
    global _active
    if rec is None:
        yield
        return
    uncount = _count_launches(rec._count_hook)
    if uncount is None:
        rec.replayable = False
    _active = rec
    try:
        yield
    finally:
        _active = None
        if uncount is not None:
            uncount()
    if rec._hook_launches != len(rec.launches):
        rec.replayable = False  # a Triton launch went around recordable(): replay would miss it


class _Recordable:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        kernel = self.kernel

        def launch(*args, **kwargs):
            compiled = kernel[grid](*args, **kwargs)
            if _active is not None:
                _active.add(kernel, compiled, grid, args, kwargs)
            return compiled

        return launch


def recordable(kernel) -> _Recordable:
    """kernel, whose launches `recordable(kernel)[grid](...)` a LaunchRecording in progress records."""
    return _Recordable(kernel)
