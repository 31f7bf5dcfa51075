"""Offline generation: the scheduler and a model runner in this process, no HTTP (like nano-vllm's LLM.generate)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from radixserve.config import ServerArgs
from radixserve.sampling import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    matched_stop: int | str | None = None
    logprobs: list = field(default_factory=list)


def resolve_model_dir(model: str | None) -> Path:
    """The model directory to serve; with none given, the SmolLM2 demo model (built on first use)."""
    if model is None:
        from radixserve.testing.smollm2 import smollm2_dir
        return smollm2_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (pass an HF directory with config.json)")
    return path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


class Engine:
    def __init__(self, model: str | None = None, **server_args):
        from radixserve.worker.model_runner import ModelRunner
        from scheduler_service.scheduler import Scheduler

        self.args = ServerArgs(model=model, **server_args)
        self.model_dir = resolve_model_dir(self.args.model)
        self.tokenizer = load_tokenizer(self.args.tokenizer or self.model_dir)
        self.runner = ModelRunner(self.args, self.model_dir)
        self.model_config = self.runner.model_config
        self.scheduler = Scheduler(self.args, self.runner.num_kv_slots, self.runner.context_len,
                                   self.model_config.eos_token_ids, self.runner.forward)
        self._ids = itertools.count()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def generate(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult] | GenerationResult:
        """Generate for one prompt (returns one result) or a list (returns a list, in order). Prompts are text or
        token ids; every request is queued at once and runs with continuous batching."""
        from scheduler_service.request import Req
        from tokenizer_service.detokenizer import IncrementalDetokenizer

        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        params_list = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(
            prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")

        reqs, detoks = [], {}
        for prompt, params in zip(prompt_list, params_list):
            params = self._as_params(params)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
            req = Req(f"engine-{next(self._ids)}", ids, params)
            self.scheduler.add_request(req)
            detoks[req.rid] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                                     params.include_stop_str_in_output)
            reqs.append(req)

        texts = {r.rid: [] for r in reqs}
        stopped_by_text: dict[str, str] = {}
        remaining = {r.rid for r in reqs}
        bar = tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm)
        while remaining:
            for out in self.scheduler.step():
                rid = out.req.rid
                if rid not in remaining:
                    continue
                if out.new_token_ids and rid not in stopped_by_text:
                    delta = detoks[rid].add_tokens(out.new_token_ids)
                    texts[rid].append(delta.text)
                    if delta.stopped:
                        # A stop string ended the text: the scheduler need not compute more.
                        stopped_by_text[rid] = delta.matched_stop
                        self.scheduler.abort(rid)
                        continue
                if out.finished:
                    if rid not in stopped_by_text:
                        texts[rid].append(detoks[rid].flush().text)
                    remaining.discard(rid)
                    bar.update(1)
        bar.close()
        results = []
        for req in reqs:
            reason, matched = req.finish_reason, req.matched_stop
            if req.rid in stopped_by_text:
                reason, matched = "stop", stopped_by_text[req.rid]
            results.append(GenerationResult(
                text="".join(texts[req.rid]), token_ids=list(req.output_ids), finish_reason=reason,
                prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens or 0, error=req.error,
                matched_stop=matched, logprobs=req.logprobs))
        return results[0] if single else results

    @staticmethod
    def _as_params(params) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        params.validate()
        return params
