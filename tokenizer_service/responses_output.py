"""Response objects of /v1/responses (plain dicts, in the shape the official `openai` client parses): the output
items of one reply, the response around them, and its usage.

A reply, once split by the chat route's machinery (reasoning.py, structured_outputs.ChatTools), is an assistant
message {"content", "reasoning_content", "tool_calls"}; as Responses output it becomes, in this order, a reasoning item
(its text as one reasoning_text part), a message item (one output_text part) and a function_call item per call.
"""

from __future__ import annotations

import uuid

from tokenizer_service.request_group import Usage
from tokenizer_service.responses_schema import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)] if status == "completed" else [],
    }


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """call: a chat tool call {"id", "function": {"name", "arguments"}}; its id is the call_id a function_call_output
    answers."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def output_items(message: dict) -> list[dict]:
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    items += [function_call_item(new_id("fc"), call) for call in message.get("tool_calls") or []]
    return items


def usage_json(usage: Usage, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def reasoning_tokens(token_ids: list[int], items: list[dict], end_token_id: int | None) -> int:
    """Output tokens spent thinking: up to and including </think>, or all of them when the reply was cut inside its
    reasoning."""
    kinds = {item["type"] for item in items}
    if "reasoning" not in kinds:
        return 0
    if end_token_id is not None and end_token_id in token_ids:
        return token_ids.index(end_token_id) + 1
    return len(token_ids) if kinds == {"reasoning"} else 0


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished reply: cut by max_output_tokens (or the context) is incomplete."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    response_id: str,
    created: int,
    model: str,
    req: ResponsesRequest,
    output: list[dict],
    status: str,
    usage: dict | None = None,
    incomplete_details: dict | None = None,
) -> dict:
    """The response, with the request's settings echoed back as OpenAI does."""
    text_format = (
        req.text.format.model_dump(by_alias=True, exclude_none=True)
        if req.text is not None and req.text.format is not None
        else {"type": "text"}
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "text": {"format": text_format},
        "reasoning": req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None},
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "metadata": req.metadata or {},
        "truncation": "disabled",
        "background": False,
        "user": req.user,
    }
