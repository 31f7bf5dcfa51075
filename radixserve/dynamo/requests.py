"""Dynamo's preprocessed request onto radixserve's, and radixserve's outputs onto Dynamo's chunks.

Dynamo's frontend sends token ids with stop_conditions, sampling_options and output_options (its
PreprocessedRequest); a worker answers with chunks of token ids, the last one with finish_reason and
completion_usage. Everything that decides anything stays radixserve's: the SamplingParams built here are validated by
check_request like any front end's, and the scheduler decides every finish, stop strings included (Dynamo's frontend
cuts them from the text it makes of the tokens; with ignore_eos it sends no stop condition at all).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixserve.protocol import RequestOutput, TokenLogprobs, unpack_i32
from radixserve.request_validation import InvalidRequest, check_request, default_max_new_tokens
from radixserve.sampling import SamplingParams

# sampling_options Dynamo may send that radixserve has no counterpart for: refused when set, never ignored.
UNSUPPORTED_SAMPLING = ("best_of", "use_beam_search", "length_penalty")


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    dp_rank: int | None


def prepare(
    request: dict, vocab_size: int, context_len: int, kv_pool_tokens: int | None, require_cache_salt: bool = False
) -> Prepared:
    """The request as radixserve runs it; InvalidRequest (a 400 at the client) for what radixserve would refuse."""
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    output = request.get("output_options") or {}
    prompt = request.get("token_ids") or []
    for name in UNSUPPORTED_SAMPLING:
        if sampling.get(name):
            raise InvalidRequest(f"{name} is not supported by the radixserve backend", name)
    if (sampling.get("n") or 1) != 1:
        raise InvalidRequest("n > 1 is not supported by the radixserve backend", "n")
    if output.get("prompt_logprobs") is not None:
        raise InvalidRequest("prompt_logprobs is not supported by the radixserve backend", "prompt_logprobs")
    max_tokens = stop.get("max_tokens")
    params = SamplingParams(
        max_new_tokens=default_max_new_tokens(len(prompt), context_len) if max_tokens is None else max_tokens,
        min_new_tokens=stop.get("min_tokens") or 0,
        ignore_eos=bool(stop.get("ignore_eos")),
        stop=list(stop.get("stop") or []),
        # Hidden ones (EOS) end the text unseen, visible ones end it seen: the scheduler stops on either, and the
        # frontend, which knows which is which, shows the token or not.
        stop_token_ids=sorted(
            {
                *(stop.get("stop_token_ids") or []),
                *(stop.get("stop_token_ids_hidden") or []),
                *(stop.get("stop_token_ids_visible") or []),
            }
        ),
        include_stop_str_in_output=bool(sampling.get("include_stop_str_in_output")),
        logprobs=output.get("logprobs"),
        **_sampling_fields(sampling),
        **_grammar_fields(sampling.get("guided_decoding")),
    )
    ids = check_request(prompt, params, vocab_size, context_len, "token_ids", kv_pool_tokens)
    routing = request.get("routing") or {}
    salt = routing.get("cache_salt") or ((request.get("extra_args") or {}).get("nvext") or {}).get("cache_salt")
    if require_cache_salt and not salt:
        raise InvalidRequest("this server requires a cache_salt on every request (--require-cache-salt)", "cache_salt")
    return Prepared(ids, params, salt or None, routing.get("dp_rank"))


def _sampling_fields(sampling: dict) -> dict[str, Any]:
    """Dynamo's sampling options that are set, under SamplingParams' names (unset ones keep radixserve's default)."""
    names = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )
    return {name: sampling[name] for name in names if sampling.get(name) is not None}


def _grammar_fields(guided: dict | None) -> dict[str, Any]:
    """Dynamo's guided_decoding (vLLM's names) as radixserve's grammar fields."""
    if not guided:
        return {}
    if guided.get("json") is not None:
        schema = guided["json"]
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if guided.get("regex") is not None:
        return {"regex": guided["regex"]}
    if guided.get("grammar") is not None:
        return {"ebnf": guided["grammar"]}
    if guided.get("choice"):
        return {"regex": "|".join(re.escape(choice) for choice in guided["choice"])}
    raise InvalidRequest(
        f"guided_decoding {sorted(guided)} is not supported by the radixserve backend", "guided_decoding"
    )


def chunk(out: RequestOutput, params: SamplingParams) -> dict[str, Any]:
    """One scheduler output as one Dynamo chunk (token ids, their logprobs when asked for)."""
    token_ids = unpack_i32(out.token_ids).tolist()
    result: dict[str, Any] = {"token_ids": token_ids, "index": 0}
    if params.logprobs is not None and out.logprobs and len(out.logprobs) == len(token_ids):
        result["log_probs"] = [lp.logprob for lp in out.logprobs]
        if params.logprobs > 0:
            result["top_logprobs"] = [_top(lp) for lp in out.logprobs]
    return result


def _top(lp: TokenLogprobs) -> list[dict[str, Any]]:
    ids = unpack_i32(lp.top_ids).tolist()
    values = memoryview(lp.top_logprobs).cast("f").tolist()
    return [
        {"rank": rank, "token_id": token, "logprob": value}
        for rank, (token, value) in enumerate(zip(ids, values), start=1)
    ]


def usage(out: RequestOutput, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
