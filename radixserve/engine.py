"""Offline generation without HTTP (like nano-vllm's LLM.generate).

`Engine` starts the same scheduler and worker processes as the server (tensor parallelism included), by module name
through radixserve.runtime.launcher, and takes the tokenizer process's place on the sockets. `InProcessEngine`
(scheduler_service/in_process_engine.py, so that this library imports no service) runs the scheduler and one model
runner inside the calling process. Both share EngineBase's generation loop: tokenize, validate, queue every request
at once, and run each output through the request's RequestPipeline (radixserve/request_pipeline.py), the same code
the HTTP server runs."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.runtime.launcher import resolve_model_dir
from radixserve.protocol import RequestOutput, TokenLogprobs
from radixserve.request_pipeline import RequestPipeline, SequenceResult
from radixserve.request_validation import check_request
from radixserve.tokenizer_loading import load_tokenizer
from radixserve.sampling import SamplingParams

Prompt = str | list[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_s: float | None = None  # from this call's submission of the request to its first token here


class EngineBase:
    """The generation loop; subclasses provide _submit, _abort and _next_outputs."""

    def __init__(self, model: str | None, server_args: dict):
        self.args = ServerArgs(model=model, **server_args)
        self.model_dir = resolve_model_dir(self.args.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.context_len = self.model_config.context_len(self.args.context_length)
        self.tokenizer = load_tokenizer(self.args.tokenizer or self.model_dir)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        # The scheduler's total KV slots, set by a subclass once its scheduler is up; None skips that check.
        self.kv_pool_tokens: int | None = None

    # transport
    def _submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def _submit_all(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Queue requests that arrive together (a transport may send them as one message)."""
        for rid, prompt_ids, params in requests:
            self._submit(rid, prompt_ids, params)

    def _abort(self, rid: str) -> None:
        raise NotImplementedError

    def _next_outputs(self) -> Iterable[RequestOutput]:
        raise NotImplementedError

    # API
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = False,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns one result) or a list (returns a list, in order). Prompts are text or
        token ids; every request is queued at once and runs with continuous batching. Raises ValueError
        (request_validation.InvalidRequest) for a bad request before anything is queued."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        prompt_list = [prompts] if single else list(prompts)
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, (list, tuple))
            else [sampling_params] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        jobs = [self._prepare(prompt, params) for prompt, params in zip(prompt_list, params_list)]

        pipelines = {}
        for index, (ids, params) in enumerate(jobs):
            rid = f"engine-{self._prefix}-{next(self._ids)}"
            pipelines[rid] = RequestPipeline(rid, ids, params, self.tokenizer, index)
        results = {rid: SequenceResult(p.index) for rid, p in pipelines.items()}
        first_token_s: dict[str, float] = {}
        bar = tqdm(total=len(pipelines), desc="Generating", disable=not use_tqdm)
        try:
            submitted = time.perf_counter()
            self._submit_all([(rid, p.prompt_ids, p.params) for rid, p in pipelines.items()])
            pending = len(pipelines)
            while pending:
                for out in self._next_outputs():
                    pipeline = pipelines.get(out.rid)
                    if pipeline is None or pipeline.finished:
                        continue  # another generate() call's request, or one this call already ended
                    if out.rid not in first_token_s and out.token_ids:
                        first_token_s[out.rid] = time.perf_counter() - submitted
                    results[out.rid].add(pipeline.process(out))
                    if pipeline.finished:
                        pending -= 1
                        bar.update(1)
        finally:
            bar.close()
            # Interrupted (Ctrl-C, an engine failure): the scheduler must not go on computing for nobody.
            for rid, pipeline in pipelines.items():
                if not pipeline.finished:
                    pipeline.end("abort")
                    self._abort(rid)
        generated = [_result(pipelines[rid], results[rid], first_token_s.get(rid)) for rid in pipelines]
        return generated[0] if single else generated

    def _prepare(self, prompt: Prompt, params) -> tuple[list[int], SamplingParams]:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return check_request(
            ids, params, self.model_config.vocab_size, self.context_len, kv_pool_tokens=self.kv_pool_tokens
        ), params


def _result(pipeline: RequestPipeline, result: SequenceResult, first_token_s: float | None) -> GenerationResult:
    return GenerationResult(
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        prompt_tokens=len(pipeline.prompt_ids),
        cached_tokens=pipeline.cached_tokens,
        error=result.error,
        matched_stop=result.matched_stop,
        logprobs=result.logprobs,
        first_token_s=first_token_s,
    )


class Engine(EngineBase):
    """The scheduler and one worker process per TP rank, started and supervised like the server's."""

    def __init__(self, model: str | None = None, **server_args):
        import zmq

        from radixserve.runtime.ipc import Channel
        from radixserve.runtime.launcher import Launcher
        from radixserve.protocol import SchedulerToTokenizer

        super().__init__(model, server_args)
        self._launcher = Launcher(self.args, serve_http=False)
        ep = self._launcher.endpoints
        self._ctx = zmq.Context()
        # We stand where the tokenizer process stands in the server (front end 0; --api-server-count is launch.py's).
        self._from_scheduler = Channel(
            self._ctx, zmq.PULL, ep.scheduler_to_front_end(0), bind=True, recv_type=SchedulerToTokenizer
        )
        self._to_scheduler = Channel(self._ctx, zmq.PUSH, ep.tokenizer_to_scheduler, bind=False)
        self._launcher.start()
        dead = self._launcher.wait_until_ready()
        if dead is not None:
            message = self._launcher.dead_child_message() or f"{dead.name} did not start"
            self.shutdown()
            raise RuntimeError(f"engine failed to start: {message}")
        self.kv_pool_tokens = self.server_info().get("kv_pool_tokens")

    def _submit(self, rid, prompt_ids, params) -> None:
        from radixserve.protocol import TokenizedRequest, pack_i32

        self._to_scheduler.send(TokenizedRequest(rid, pack_i32(prompt_ids), params, time.time()))

    def _submit_all(self, requests) -> None:
        from radixserve.protocol import TokenizedBatch, TokenizedRequest, pack_i32

        if len(requests) == 1:
            return self._submit(*requests[0])
        now = time.time()
        batch = [TokenizedRequest(rid, pack_i32(ids), params, now) for rid, ids, params in requests]
        self._to_scheduler.send(TokenizedBatch(batch))

    def _abort(self, rid) -> None:
        from radixserve.protocol import AbortRequest

        if "_launcher" in self.__dict__:  # after shutdown() there is no scheduler left to tell
            self._to_scheduler.send(AbortRequest(rid))

    def _next_outputs(self):
        from radixserve.protocol import BatchOutput

        while True:
            message = self._from_scheduler.recv(timeout_ms=500, spin_s=self.args.spin_wait_ms / 1e3)
            if isinstance(message, BatchOutput):
                return message.outputs
            if message is None:
                dead = self._launcher.dead_child_message()
                if dead is not None:
                    self.shutdown()
                    raise RuntimeError(f"engine process died: {dead}")

    def _ask_scheduler(self, message, reply_type):
        self._to_scheduler.send(message)
        while True:
            reply = self._from_scheduler.recv(timeout_ms=10_000)
            if reply is None:
                raise RuntimeError("the scheduler did not answer")
            if isinstance(reply, reply_type) and reply.request_id == message.request_id:
                return reply

    def server_info(self) -> dict:
        """The scheduler's counters: running/waiting requests, KV slot usage, steps, tokens computed and cached."""
        from radixserve.protocol import ServerInfo, ServerInfoRequest

        return self._ask_scheduler(ServerInfoRequest(uuid.uuid4().hex), ServerInfo).info

    def flush_cache(self) -> bool:
        """Empty the prefix cache (only while no request runs)."""
        from radixserve.protocol import FlushCacheRequest, FlushCacheResult

        return self._ask_scheduler(FlushCacheRequest(uuid.uuid4().hex), FlushCacheResult).success

    def shutdown(self) -> None:
        launcher = self.__dict__.pop("_launcher", None)
        if launcher is None:
            return
        self._from_scheduler.close()
        self._to_scheduler.close()
        launcher.stop()
        self._ctx.term()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown: best effort
            pass
