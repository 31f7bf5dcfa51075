"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A request is turned into the chat route's request (responses_schema.py) and from there takes the chat route's path:
the chat template rendered off the event loop (Tokenization.encode_chat, spliced onto the previous turn's exact
tokens by responses_prompt.py), structured outputs and tool calls (structured_outputs.py), the reasoning split
(reasoning.py), build_prompts, submit and collect (serving.py). Only the shape of the answer differs
(responses_output.py, responses_stream.py).

Stored responses (responses_store.py) belong to the API key and the cache_salt they were made with: GET, DELETE and
previous_response_id take the salt (a query parameter for GET and DELETE) and answer 404 for another's, as for an
unknown or expired id. With several front ends (--api-server-count) they share one store, so a follow-up finds its
previous turn whichever front end takes it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request

from tokenizer_service.errors import JSONResponse, RequestError
from tokenizer_service.openai_schema import ChatCompletionRequest, to_sampling_fields
from tokenizer_service.openapi_docs import OPENAI_RESPONSES, documented
from tokenizer_service.request_fields import _check_cache_salt
from tokenizer_service.responses_output import (
    new_id,
    output_items,
    reasoning_tokens,
    response_object,
    status_of,
    usage_json,
)
from tokenizer_service.responses_prompt import turn_prompt
from tokenizer_service.responses_schema import CHAT_TO_RESPONSES, ResponsesRequest
from tokenizer_service.responses_store import ResponseStore, StoredResponse, owner_of, pack_ids
from tokenizer_service.responses_stream import ResponseEvents
from tokenizer_service.serving import (
    ServingContext,
    build_prompts,
    check_cache_salt,
    check_model,
    collect,
    parse_body,
    submit,
)
from tokenizer_service.streaming import EventStreamResponse, merged_outputs
from tokenizer_service.structured_outputs import ChatTools


def conversation_message(items: list[dict]) -> dict:
    """This turn's output as the assistant message the next turn's prompt renders (its reasoning left out, as the
    chat templates leave out earlier turns' thinking)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


@dataclass
class Turn:
    """One POST /v1/responses in flight: what its answer and its stored entry are made of."""

    id: str
    created: int
    req: ResponsesRequest
    owner: str
    conversation: list[dict]  # the conversation before this turn's output, without the instructions
    prompt_ids: list[int]
    reply: object  # reasoning.ReasoningReply or structured_outputs.ChatTools: the reply's shaping


def add_responses_routes(app: FastAPI, ctx: ServingContext) -> None:
    store = ResponseStore(ctx.args.responses_store_size, ctx.args.responses_store_ttl, path=ctx.responses_db)
    end_token_id = ctx.reasoning.end_token_id if ctx.reasoning is not None else None

    async def lookup(request: Request, response_id: str, cache_salt: str | None, param: str | None) -> StoredResponse:
        check_cache_salt(ctx, cache_salt)
        owner = owner_of(request.headers.get("authorization"), ctx.args.api_key)
        entry = await store.run(store.get, owner, cache_salt, response_id)
        if entry is None:
            raise RequestError(
                f"No response with id '{response_id}' is stored here (unknown, expired, deleted or "
                "made with another cache_salt).",
                status=404,
                type="not_found_error",
                param=param,
            )
        return entry

    def query_salt(cache_salt: str | None) -> str | None:
        try:
            return _check_cache_salt(cache_salt)
        except ValueError as e:
            raise RequestError(str(e), param="cache_salt") from None

    async def finish(turn: Turn, items: list[dict], token_ids: list[int], finish_reason: str | None, usage) -> dict:
        """The finished response, stored when the request asked for it."""
        status, incomplete = status_of(finish_reason)
        message = conversation_message(items)
        body = response_object(
            turn.id,
            turn.created,
            ctx.model_name,
            turn.req,
            items,
            status,
            usage_json(usage, reasoning_tokens(token_ids, items, end_token_id)),
            incomplete,
        )
        if turn.req.store:
            await store.run(
                store.put,
                StoredResponse(
                    turn.id,
                    turn.owner,
                    turn.req.cache_salt,
                    body,
                    turn.conversation + [message],
                    pack_ids(turn.prompt_ids),
                    pack_ids(token_ids),
                ),
            )
        return body

    async def stream(turn: Turn, group):
        events = ResponseEvents(response_object(turn.id, turn.created, ctx.model_name, turn.req, [], "in_progress"))
        for event in events.start():
            yield event
        token_ids, finish_reason = [], None
        async for out in merged_outputs(group):
            if out.error is not None:
                for event in events.failed(out.error, out.error_status):
                    yield event
                return
            if out.finish_reason == "abort":  # the client went away
                continue
            token_ids += out.token_ids
            delta, reason = turn.reply.stream_delta(0, out.text, out.finished, out.finish_reason)
            for event in events.delta(delta):
                yield event
            if out.finished:
                finish_reason = reason
        for event in events.close():  # the last item first: the finished response lists it
            yield event
        for event in events.complete(await finish(turn, events.items, token_ids, finish_reason, group.usage())):
            yield event

    @app.post("/v1/responses", **documented(ResponsesRequest, OPENAI_RESPONSES["responses"]))
    async def create_response(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, ResponsesRequest)
        check_model(ctx, req.model)
        previous = (
            await lookup(request, req.previous_response_id, req.cache_salt, "previous_response_id")
            if req.previous_response_id is not None
            else None
        )
        # Validating a long conversation as a chat request takes a while: not on the event loop.
        chat, conversation = await asyncio.to_thread(
            req.chat_request, previous.conversation if previous is not None else []
        )
        prompt = await turn_prompt(ctx.tokenization, chat, previous)
        fields, reply = await _chat_fields(ctx, chat, prompt)
        prompts = build_prompts(ctx, fields, [prompt], "input", from_tokenizer=True)
        turn = Turn(
            new_id("resp"),
            int(time.time()),
            req,
            owner_of(request.headers.get("authorization"), ctx.args.api_key),
            conversation,
            prompts[0][0],
            reply,
        )
        group = submit(ctx, turn.id, prompts, 1, arrival, cache_salt=req.cache_salt)
        if req.stream:
            return EventStreamResponse(stream(turn, group), group)
        result = (await collect(request, group))[0]
        message, finish_reason = reply.message(result.text, result.finish_reason)
        return JSONResponse(await finish(turn, output_items(message), result.token_ids, finish_reason, group.usage()))

    @app.get("/v1/responses/{response_id}", **documented(None, OPENAI_RESPONSES["response"]))
    async def get_response(request: Request, response_id: str, cache_salt: str | None = None):
        return JSONResponse((await lookup(request, response_id, query_salt(cache_salt), None)).body)

    @app.delete("/v1/responses/{response_id}", **documented(None, OPENAI_RESPONSES["response_deleted"]))
    async def delete_response(request: Request, response_id: str, cache_salt: str | None = None):
        entry = await lookup(request, response_id, query_salt(cache_salt), None)
        await store.run(store.delete, entry.owner, entry.cache_salt, entry.id)
        return JSONResponse({"id": entry.id, "object": "response.deleted", "deleted": True})


async def _chat_fields(ctx: ServingContext, chat: ChatCompletionRequest, prompt: list[int]):
    """The chat route's sampling fields of the turn (its grammar checked) and the shaping of its reply."""
    fields = to_sampling_fields(chat)
    fields.pop("n")
    try:
        await ctx.grammar_check.check(fields)
    except RequestError as e:  # named by the Responses field
        e.param = CHAT_TO_RESPONSES.get(e.param, e.param)
        raise
    reply = ChatTools(chat, ctx.args.tool_call_parser, ctx.tokenizer)
    if ctx.reasoning is not None:
        reply = ctx.reasoning.reply(reply, prompt, fields)
    return fields, reply
