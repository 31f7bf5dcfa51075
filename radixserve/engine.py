"""Offline generation without HTTP (like nano-vllm's LLM.generate).

`Engine` starts the same scheduler and worker processes as the server (tensor parallelism included) and takes the
tokenizer process's place on the sockets. `InProcessEngine` runs the scheduler and one model runner inside this
process: no sockets, direct access to the scheduler (tests, benchmarks of the scheduler, debugging).
Both share the generation loop: tokenize, queue every request at once, detokenize as tokens arrive, stop strings."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from radixserve.config import ModelConfig, ServerArgs
from radixserve.launcher import resolve_model_dir
from radixserve.protocol import RequestOutput, TokenLogprobs, unpack_i32
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


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


class _EngineBase:
    """The generation loop; subclasses provide _submit, _abort and _next_outputs."""

    def __init__(self, model: str | None, server_args: dict):
        self.args = ServerArgs(model=model, **server_args)
        self.model_dir = resolve_model_dir(self.args.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.context_len = self.model_config.context_len(self.args.context_length)
        self.tokenizer = load_tokenizer(self.args.tokenizer or self.model_dir)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    # transport
    def _submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def _abort(self, rid: str) -> None:
        raise NotImplementedError

    def _next_outputs(self) -> Iterable[RequestOutput]:
        raise NotImplementedError

    # API
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
                 use_tqdm: bool = False) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns one result) or a list (returns a list, in order). Prompts are text or
        token ids; every request is queued at once and runs with continuous batching."""
        from tokenizer_service.detokenizer import IncrementalDetokenizer

        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        prompt_list = [prompts] if single else list(prompts)
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompt_list))
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        jobs = [self._prepare(prompt, params) for prompt, params in zip(prompt_list, params_list)]

        states: dict[str, _Generation] = {}
        for ids, params in jobs:
            rid = f"engine-{self._prefix}-{next(self._ids)}"
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
            states[rid] = _Generation(len(ids), detok)
            self._submit(rid, ids, params)
        order = list(states)
        bar = tqdm(total=len(states), desc="Generating", disable=not use_tqdm)
        pending = set(states)
        while pending:
            for out in self._next_outputs():
                state = states.get(out.rid)
                if state is None or out.rid not in pending:
                    continue  # a request aborted by a stop string still has outputs in flight
                if state.add(out):
                    if not out.finished:
                        self._abort(out.rid)  # a stop string ended the text: no need to compute more
                    pending.discard(out.rid)
                    bar.update(1)
        bar.close()
        results = [states[rid].result() for rid in order]
        return results[0] if single else results

    def _prepare(self, prompt: Prompt, params) -> tuple[list[int], SamplingParams]:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        if len(ids) + params.max_new_tokens > self.context_len:
            raise ValueError(f"This model's maximum context length is {self.context_len} tokens. However, you "
                             f"requested {len(ids) + params.max_new_tokens} tokens ({len(ids)} in the prompt, "
                             f"{params.max_new_tokens} for the completion).")
        return ids, params


class _Generation:
    """One request's progress in Engine.generate."""

    def __init__(self, prompt_tokens: int, detokenizer):
        self.prompt_tokens = prompt_tokens
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.matched_stop = None
        self.cached_tokens = 0
        self.error = None

    def add(self, out: RequestOutput) -> bool:
        """Take one output; True once the request is done (finished by the scheduler or by a stop string)."""
        new = unpack_i32(out.token_ids).tolist()
        self.token_ids += new
        self.logprobs += [lp for lp in out.logprobs if lp is not None]
        self.cached_tokens = out.cached_tokens
        if new:
            delta = self.detokenizer.add_tokens(new)
            self.text.append(delta.text)
            if delta.stopped:
                self.finish_reason, self.matched_stop = "stop", delta.matched_stop
                return True
        if out.finished:
            self.text.append(self.detokenizer.flush().text)
            self.finish_reason, self.matched_stop, self.error = out.finish_reason, out.matched_stop_token, out.error
            return True
        return False

    def result(self) -> GenerationResult:
        return GenerationResult(text="".join(self.text), token_ids=self.token_ids, finish_reason=self.finish_reason,
                                prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, error=self.error,
                                matched_stop=self.matched_stop, logprobs=self.logprobs)


class InProcessEngine(_EngineBase):
    """Scheduler and model runner in this process (tensor parallelism needs the multi-process Engine)."""

    def __init__(self, model: str | None = None, **server_args):
        from radixserve.worker.model_runner import ModelRunner
        from scheduler_service.scheduler import Scheduler

        super().__init__(model, server_args)
        if self.args.tp_size != 1:
            raise ValueError("InProcessEngine runs one rank; use Engine for --tp-size > 1")
        self.runner = ModelRunner(self.args, self.model_dir)
        self.scheduler = Scheduler(self.args, self.runner.num_kv_slots, self.runner.context_len,
                                   self.model_config.eos_token_ids, self.runner.forward)

    def _submit(self, rid, prompt_ids, params) -> None:
        from scheduler_service.request import Req
        self.scheduler.add_request(Req(rid, prompt_ids, params))

    def _abort(self, rid) -> None:
        self.scheduler.abort(rid)

    def _next_outputs(self):
        return [out.to_message() for out in self.scheduler.step()]


class Engine(_EngineBase):
    """The scheduler and one worker process per TP rank, started and supervised like the server's."""

    def __init__(self, model: str | None = None, **server_args):
        import zmq

        from radixserve.ipc import Channel
        from radixserve.launcher import Launcher
        from radixserve.protocol import SchedulerToTokenizer

        super().__init__(model, server_args)
        self._launcher = Launcher(self.args, serve_http=False)
        ep = self._launcher.endpoints
        self._ctx = zmq.Context()
        # We stand where the tokenizer process stands in the server.
        self._from_scheduler = Channel(self._ctx, zmq.PULL, ep.scheduler_to_tokenizer, bind=True,
                                       recv_type=SchedulerToTokenizer)
        self._to_scheduler = Channel(self._ctx, zmq.PUSH, ep.tokenizer_to_scheduler, bind=False)
        self._launcher.start()
        dead = self._launcher.wait_until_ready()
        if dead is not None:
            message = self._launcher.dead_child_message() or f"{dead.name} did not start"
            self.shutdown()
            raise RuntimeError(f"engine failed to start: {message}")

    def _submit(self, rid, prompt_ids, params) -> None:
        from radixserve.protocol import TokenizedRequest, pack_i32
        self._to_scheduler.send(TokenizedRequest(rid, pack_i32(prompt_ids), params, time.time()))

    def _abort(self, rid) -> None:
        from radixserve.protocol import AbortRequest
        self._to_scheduler.send(AbortRequest(rid))

    def _next_outputs(self):
        from radixserve.protocol import BatchOutput
        while True:
            message = self._from_scheduler.recv(timeout_ms=500)
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
