"""Response bodies: OpenAI completions, chat completions, their stream chunks, usage and logprobs, and the native
/generate results (SGLang's shape). Plain dicts, encoded by the caller.

Logprob token strings are the decoded text of each single token (what OpenAI shows), not the tokenizer's internal
piece ("Ġhello"). A token that is only part of a UTF-8 character decodes to U+FFFD; chat logprobs carry the
UTF-8 bytes of that string as OpenAI's `bytes` field. -inf logprobs (impossible tokens) are clamped to -9999.0
because JSON has no infinity.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from radixserve.protocol import TokenLogprobs
from radixserve.request_pipeline import SequenceResult
from tokenizer_service.request_group import Usage

MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _top(entry: TokenLogprobs) -> list[tuple[int, float]]:
    ids = np.frombuffer(entry.top_ids, dtype=np.int32).tolist()
    values = np.frombuffer(entry.top_logprobs, dtype=np.float32).tolist()
    return list(zip(ids, values))


def usage_json(usage: Usage) -> dict:
    """Also each chunk's usage with stream_options.continuous_usage_stats (the tokens of one choice so far)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


# ------------------------------------------------------------------------------------------ completions


class Echo(NamedTuple):
    """/v1/completions with echo: what goes before a choice's completion. logprobs: one per prompt token when the
    request asked for logprobs, None for the first (nothing predicts it), as OpenAI and vLLM send it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def echo_of(prompt_text: str, prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None]) -> Echo:
    """prompt_logprobs: those of positions 1.. (radixserve.request_pipeline.RequestPipeline.prompt_logprobs)."""
    entries = [None, *prompt_logprobs][: len(prompt_ids)]
    return Echo(prompt_text, list(prompt_ids), entries + [None] * (len(prompt_ids) - len(entries)))


def completion_logprobs(
    token_ids: list[int], logprobs: list[TokenLogprobs | None], token_text: TokenText, text_offset: int = 0
) -> dict:
    """The legacy completions `logprobs` object. text_offset: where these tokens start in the completion text
    (non-zero for a stream chunk after the first). top_logprobs holds the top k plus the sampled token, as
    OpenAI and vLLM do. An entry None (an echoed prompt's first token) is null in both lists."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamp(entry.logprob))
        top = {token_text(i): _clamp(v) for i, v in _top(entry)}
        top.setdefault(text, _clamp(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def echoed_logprobs(
    echo: Echo | None, token_ids: list[int], logprobs: list[TokenLogprobs], token_text: TokenText, text_offset: int = 0
) -> dict:
    """completion_logprobs of the completion's tokens, after the echoed prompt's when there is one."""
    if echo is None:
        return completion_logprobs(token_ids, logprobs, token_text, text_offset)
    return completion_logprobs(echo.token_ids + token_ids, echo.logprobs + list(logprobs), token_text, text_offset)


def completion_response(
    request_id: str,
    created: int,
    model: str,
    results: list[SequenceResult],
    usage: Usage,
    token_text: TokenText,
    want_logprobs: bool,
    echoes: dict[int, Echo] | None = None,
) -> dict:
    """echoes: by choice index, the prompt that goes before each completion (echo)."""
    choices = []
    for r in results:
        echo = (echoes or {}).get(r.index)
        choices.append(
            {
                "index": r.index,
                "text": r.text if echo is None else echo.text + r.text,
                "logprobs": echoed_logprobs(echo, r.token_ids, r.logprobs, token_text) if want_logprobs else None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.matched_stop,  # vLLM's extension: the stop string or token id that matched
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(usage),
    }


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict | None,
    with_usage_field: bool,
    stop_reason: int | str | None = None,
    usage: dict | None = None,
) -> dict:
    chunk = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }
    if with_usage_field:
        chunk["usage"] = usage  # OpenAI: null on every chunk but the final usage chunk (unless continuous_usage_stats)
    return chunk


def completion_usage_chunk(request_id: str, created: int, model: str, usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


# ------------------------------------------------------------------------------------------------- chat


def _logprob_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs], token_text: TokenText) -> dict:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        item = _logprob_entry(token_text(token_id), entry.logprob)
        item["top_logprobs"] = [_logprob_entry(token_text(i), v) for i, v in _top(entry)]
        content.append(item)
    return {"content": content}


def chat_response(
    request_id: str,
    created: int,
    model: str,
    results: list[SequenceResult],
    usage: Usage,
    token_text: TokenText,
    want_logprobs: bool,
    tools=None,
    echo: str = "",
) -> dict:
    """tools: the request's structured_outputs.ChatTools, which splits a reply into content and tool_calls. echo:
    the pre-filled start of the reply (a chat's echo), before every choice's content; logprobs stay the generated
    tokens' only."""
    choices = []
    for r in results:
        message, finish_reason = (
            ({"role": "assistant", "content": r.text}, r.finish_reason)
            if tools is None
            else tools.message(r.text, r.finish_reason)
        )
        if echo:
            message["content"] = echo + (message.get("content") or "")
        choices.append(
            {
                "index": r.index,
                "message": message,
                "logprobs": chat_logprobs(r.token_ids, r.logprobs, token_text) if want_logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": r.matched_stop,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(usage),
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    delta: dict,
    finish_reason: str | None,
    logprobs: dict | None,
    with_usage_field: bool,
    stop_reason: int | str | None = None,
    usage: dict | None = None,
) -> dict:
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }
    if with_usage_field:
        chunk["usage"] = usage
    return chunk


def chat_usage_chunk(request_id: str, created: int, model: str, usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


# ------------------------------------------------------------------------------------------- native


def native_finish_reason(finish_reason: str | None, matched_stop: int | str | None, completion_tokens: int):
    """SGLang's shape: {"type": "stop", "matched": <token id or string>} or {"type": "length", "length": n}."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish_reason == "stop":
        return {"type": "stop", "matched": matched_stop}
    return {"type": finish_reason}


def native_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    """SGLang's output_token_logprobs / output_top_logprobs: [logprob, token_id, None] triples (the text slot is
    left empty as SGLang does unless asked for)."""
    return {
        "output_token_logprobs": [[_clamp(e.logprob), t, None] for t, e in zip(token_ids, logprobs)],
        "output_top_logprobs": [[[_clamp(v), i, None] for i, v in _top(e)] for e in logprobs],
    }


def native_result(
    request_id: str,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    matched_stop: int | str | None,
    prompt_tokens: int,
    cached_tokens: int,
    logprobs: list[TokenLogprobs] | None,
    e2e_latency: float | None,
) -> dict:
    meta = {
        "id": f"{request_id}-{index}",
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(token_ids),
        "cached_tokens": cached_tokens,
        "finish_reason": native_finish_reason(finish_reason, matched_stop, len(token_ids)),
        "e2e_latency": e2e_latency,
    }
    if logprobs is not None:
        meta.update(native_logprobs(token_ids, logprobs))
    return {"text": text, "output_ids": token_ids, "index": index, "meta_info": meta}
