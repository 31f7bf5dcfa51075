"""InProcessEngine: Engine's API (radixserve/engine.py) with the scheduler and one model runner inside the calling
process: no sockets and no child processes, direct access to the scheduler and its step loop (scheduler tests,
benchmarks of the scheduler, debugging). It lives with the scheduler because it builds one; the library below
(radixserve/) imports no service package."""

from __future__ import annotations

from radixserve.engine import EngineBase
from radixserve.worker.model_runner import ModelRunner
from scheduler_service.executor import InProcessExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import make_step_loop
from scheduler_service.step_output import messages


class InProcessEngine(EngineBase):
    """Scheduler and model runner in this process (tensor parallelism needs the multi-process Engine)."""

    def __init__(self, model: str | None = None, **server_args):
        super().__init__(model, server_args)
        if self.args.tp_size != 1:
            raise ValueError("InProcessEngine runs one rank; use Engine for --tp-size > 1")
        self.runner = ModelRunner(self.args, self.model_dir)
        self.scheduler = Scheduler(
            self.args,
            self.runner.num_kv_slots,
            self.runner.context_len,
            self.model_config.eos_token_ids,
            self.tokenizer,
            self.runner.num_host_slots,
            num_layers=self.model_config.num_layers,
        )
        self.kv_pool_tokens = self.scheduler.max_sequence_tokens()
        # The server's step loop, with the model runner in this process instead of the worker processes.
        self.loop = make_step_loop(self.scheduler, InProcessExecutor(self.runner))

    def _submit(self, rid, prompt_ids, params) -> None:
        self.scheduler.add_request(Req(rid, prompt_ids, params))

    def _abort(self, rid) -> None:
        self.scheduler.abort(rid)

    def _next_outputs(self):
        return messages(self.loop.step())
