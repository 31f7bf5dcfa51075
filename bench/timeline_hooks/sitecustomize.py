"""Imported by every Python process started with this folder on PYTHONPATH (bench/process_timeline.py does so):
when RADIXSERVE_TIMELINE_DIR is set, the functions in HOOKS write a line at their entry and exit to
DIR/t<pid>.txt, with time.monotonic_ns(), one clock for every process of the machine. A benchmark tool only: it
shadows any other sitecustomize, and each hook costs ~2-5 us."""

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

# module -> (class or None for a module function, function name)
HOOKS = {
    "radixserve.engine": [("Engine", "_submit"), ("Engine", "_next_outputs")],
    "scheduler_service.process": [("SchedulerProcess", "_handle"), ("SchedulerProcess", "_send_outputs")],
    "scheduler_service.scheduler": [("Scheduler", "schedule"), ("Scheduler", "process_results")],
    "scheduler_service.executor": [("WorkerProcessesExecutor", "launch"), ("WorkerProcessesExecutor", "collect")],
    "radixserve.worker.step_pipeline": [("StepPipeline", "launch"), ("StepPipeline", "finish")],
    "radixserve.worker.model_runner": [
        ("ModelRunner", "prepare"),
        ("ModelRunner", "compute_logits"),
        ("ModelRunner", "sample"),
        ("ModelRunner", "finish_step"),
    ],
    "radixserve.runtime.ipc": [("Channel", "send"), ("Channel", "recv")],
    # The HTTP process (bench/burst_timeline.py): a request reaching the app, its prompt built, its submission, and
    # each batch of outputs handled.
    "tokenizer_service.middleware": [("HostCheckMiddleware", "__call__")],
    "tokenizer_service.serving": [(None, "build_prompts")],
    "tokenizer_service.request_manager": [("RequestManager", "submit"), ("RequestManager", "_on_batch")],
}
_fd = None


def _log(name: str, phase: str) -> None:
    global _fd
    if _fd is None:
        _fd = os.open(
            f"{os.environ['RADIXSERVE_TIMELINE_DIR']}/t{os.getpid()}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
    os.write(_fd, f"{time.monotonic_ns()} {phase} {name}\n".encode())


def _hooked(fn, name: str):
    @functools.wraps(fn)
    def hooked(*args, **kwargs):
        _log(name, "B")
        try:
            return fn(*args, **kwargs)
        finally:
            _log(name, "E")

    return hooked


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for owner_name, fn_name in HOOKS[name]:
                owner = getattr(module, owner_name) if owner_name else module
                label = f"{owner_name}.{fn_name}" if owner_name else fn_name
                setattr(owner, fn_name, _hooked(getattr(owner, fn_name), label))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("RADIXSERVE_TIMELINE_DIR"):
    os.makedirs(os.environ["RADIXSERVE_TIMELINE_DIR"], exist_ok=True)
    sys.meta_path.insert(0, _Finder())
