"""What every route shares: the serving context (model shape, tokenizer, request manager) and the steps of a
generating request before and after the scheduler.

A generating request's path: parse the body (strict pydantic models of openai_schema, read as raw bytes so FastAPI
neither coerces types nor answers in its own error shape) -> check the model name -> tokenize (tokenization.py,
off the event loop) -> resolve max_tokens against the context -> SamplingParams -> RequestManager.submit -> stream
SSE chunks (streaming.py) or collect the results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.request_validation import check_params_and_length, check_prompt_ids, default_max_new_tokens
from radixserve.sampling import SamplingParams
from tokenizer_service.errors import RequestError, error_for_status
from tokenizer_service.metrics import ServerMetrics
from tokenizer_service.openai_schema import openai_error_from_validation
from tokenizer_service.reasoning import ReasoningParser
from tokenizer_service.request_group import RequestGroup
from tokenizer_service.request_manager import EngineOverloaded, EngineUnavailable, RequestManager, TooManySequences
from tokenizer_service.streaming import abort_on_disconnect, first_error
from tokenizer_service.structured_outputs import GrammarCheck
from tokenizer_service.tokenization import Tokenization

RETRY_AFTER_S = 1


@dataclass
class ServingContext:
    """What every route needs: the model's shape, the tokenizer and the request manager."""

    args: ServerArgs
    model_dir: str
    model_name: str
    model_config: ModelConfig
    context_len: int
    tokenizer: Any
    manager: RequestManager
    metrics: ServerMetrics
    started_at: int
    tokenization: Tokenization | None = None  # built from the fields above when not given
    responses_db: str = ":memory:"  # the stored responses' sqlite database (a shared file with several front ends)

    def __post_init__(self):
        tokenizer = self.tokenizer
        # Compiles each request's grammar before admission (a bad one is a 400); see structured_outputs.py.
        self.grammar_check = GrammarCheck(
            self.args.grammar_backend,
            self.tokenizer,
            self.vocab_size,
            self.model_config.eos_token_ids,
            unroll_bounded_strings=not self.args.disable_grammar_string_unrolling,
        )
        if self.tokenization is None:
            cache_mib = 0 if self.args.disable_chat_segment_cache else self.args.chat_segment_cache_mib
            self.tokenization = Tokenization(
                tokenizer, self.context_len, self.args.tokenizer_workers, cache_mib, self.args.inline_tokenize_chars
            )
        segments = getattr(self.tokenization, "segments", None)
        if segments is not None:
            self.metrics.watch_segment_cache(segments.cache)

        # Logprob token strings: each token's own text; a vocabulary is small enough to cache whole.
        @functools.lru_cache(maxsize=1 << 18)
        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

        self.token_text = token_text
        # --reasoning-parser: chat replies' <think> blocks split off as reasoning_content (reasoning.py)
        self.reasoning = (
            ReasoningParser(self.args.reasoning_parser, tokenizer, token_text) if self.args.reasoning_parser else None
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


async def parse_body(request: Request, model):
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        error = openai_error_from_validation(e)["error"]
        raise RequestError(error["message"], param=error["param"]) from None


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise RequestError(f"The model `{model}` does not exist.", status=404, type="not_found_error", param="model")


def prompt_ids(ids: list[int], vocab_size: int, param: str, from_tokenizer: bool) -> list[int]:
    """check_prompt_ids, once per prompt. Ids this process's tokenizer produced are a list of Python ints already:
    for them a range check by min / max (~1 us per 100 tokens) stands for its per-token passes (a numpy copy and
    an int() of every id, ~75 us for 1,500 tokens, which a burst of chat requests paid twice per request on the
    event loop); any doubt (empty, out of range) goes the full way, for its error message."""
    if from_tokenizer and ids and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    return check_prompt_ids(ids, vocab_size, param)


def build_prompts(
    ctx: ServingContext,
    fields: dict,
    prompts: list[list[int]],
    param: str = "prompt",
    from_tokenizer: bool = False,
) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt with its SamplingParams, validated (radixserve.request_validation.check_request's checks, the
    ones Engine runs too, with the prompt ids checked once); max_new_tokens None means the rest of the context.
    from_tokenizer: the prompts are the tokenizer's output (lists of Python ints), not ids a client sent."""
    out = []
    for ids in prompts:
        ids = prompt_ids(ids, ctx.vocab_size, param, from_tokenizer)
        max_new_tokens = fields["max_new_tokens"]
        if max_new_tokens is None:
            max_new_tokens = default_max_new_tokens(len(ids), ctx.context_len)
        params = SamplingParams(**{**fields, "max_new_tokens": max_new_tokens})
        check_params_and_length(ids, params, ctx.vocab_size, ctx.context_len, ctx.manager.kv_pool_tokens)
        out.append((ids, params))
    return out


def check_cache_salt(ctx: ServingContext, cache_salt: str | None) -> None:
    """--require-cache-salt: every request names its tenant's cache namespace."""
    if cache_salt is None and ctx.args.require_cache_salt:
        raise RequestError(
            "This server requires a cache_salt on every request (--require-cache-salt): the cached "
            "prompts of different tenants are kept apart by it.",
            param="cache_salt",
        )


def check_priority(ctx: ServingContext, priority: int) -> None:
    """A priority means something only with --enable-priority-scheduling; without it a non-zero one is refused
    rather than silently ignored, as vLLM refuses it."""
    if priority != 0 and not ctx.args.enable_priority_scheduling:
        raise RequestError(
            f"Got priority {priority}, but priority scheduling is not enabled on this server "
            "(--enable-priority-scheduling).",
            param="priority",
        )


def submit(
    ctx: ServingContext,
    request_id: str,
    prompts,
    n: int,
    arrival: float,
    cache_salt: str | None = None,
    priority: int = 0,
) -> RequestGroup:
    check_cache_salt(ctx, cache_salt)
    check_priority(ctx, priority)
    try:
        return ctx.manager.submit(request_id, prompts, n, arrival, cache_salt=cache_salt, priority=priority)
    except TooManySequences as e:
        raise RequestError(str(e), param="n") from None
    except EngineOverloaded as e:
        raise RequestError(
            str(e), status=503, type="service_unavailable_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    except EngineUnavailable as e:
        raise error_for_status(str(e), 503) from None


async def collect(request: Request, group: RequestGroup):
    async with abort_on_disconnect(request.receive, group):
        results = await group.collect()
    error = first_error(results)
    if error is not None:
        raise error
    return results
