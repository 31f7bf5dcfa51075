"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

The two generating routes differ only in how the prompt is built (text or token ids vs. the chat template), the
defaults of max_tokens (completions 16, OpenAI's default; chat the rest of the context, as vLLM; an explicit null
means the rest of the context for both) and the shape of their responses; the rest is `_generate`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from tokenizer_service import openai_responses as R
from tokenizer_service.errors import JSONResponse
from tokenizer_service.openai_schema import ChatCompletionRequest, CompletionRequest, to_sampling_fields
from tokenizer_service.openapi_docs import OPENAI_RESPONSES, documented
from tokenizer_service.serving import ServingContext, build_prompts, check_model, collect, parse_body, submit
from tokenizer_service.streaming import EventStreamResponse, OpenAIStream, openai_events
from tokenizer_service.structured_outputs import ChatTools


async def _generate(
    ctx: ServingContext,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    arrival: float,
    chat: bool,
    want_logprobs: bool,
):
    fields = to_sampling_fields(req)
    n = fields.pop("n")
    await ctx.grammar_check.check(fields)  # a grammar that does not compile is a 400 (structured_outputs.py)
    tools = ChatTools(req, ctx.args.tool_call_parser, ctx.tokenizer) if chat else None
    if chat and ctx.reasoning is not None:  # --reasoning-parser: the <think> block becomes reasoning_content
        tools = ctx.reasoning.reply(tools, prompts[0], fields)
    # Chat prompts and text prompts are the tokenizer's ids; only a completion's id prompts came from the client.
    from_tokenizer = chat or isinstance(req.prompt, str) or all(isinstance(p, str) for p in req.prompt)
    prompts = build_prompts(ctx, fields, prompts, "messages" if chat else "prompt", from_tokenizer)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    echo_texts = await _echo_texts(ctx, req, prompts) if not chat and req.echo else None
    if chat and req.echoed_text():
        echo_texts = [req.echoed_text()]  # the one prompt's: a pre-filled start of the reply
    group = submit(ctx, request_id, prompts, n, arrival, cache_salt=req.cache_salt, priority=req.priority)
    if req.stream:
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        # As vLLM: usage on every chunk only when the final usage chunk is asked for too.
        continuous_usage = include_usage and options.continuous_usage_stats
        stream = OpenAIStream(chat, ctx.token_text, tools, echo_texts, continuous_usage)
        events = openai_events(stream, group, request_id, created, ctx.model_name, want_logprobs, include_usage)
        return EventStreamResponse(events, group)
    results = await collect(request, group)
    if chat:
        return JSONResponse(
            R.chat_response(
                request_id,
                created,
                ctx.model_name,
                results,
                group.usage(),
                ctx.token_text,
                want_logprobs,
                tools,
                echo_texts[0] if echo_texts else "",
            )
        )
    echoes = None
    if echo_texts is not None:
        echoes = {
            seq.index: R.echo_of(echo_texts[seq.prompt_index], seq.prompt_ids, seq.prompt_logprobs)
            for seq in group.sequences
        }
    return JSONResponse(
        R.completion_response(
            request_id, created, ctx.model_name, results, group.usage(), ctx.token_text, want_logprobs, echoes
        )
    )


async def _echo_texts(ctx: ServingContext, req: CompletionRequest, prompts) -> list[str]:
    """Each prompt as the client sent it, for echo: its text, or the text of its token ids."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(p, str) for p in req.prompt):
        return list(req.prompt)
    return [await ctx.tokenization.decode(ids) for ids, _ in prompts]  # in the tokenizer pool: off the event loop


def add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:

    @app.post("/v1/completions", **documented(CompletionRequest, OPENAI_RESPONSES["completion"]))
    async def completions(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, CompletionRequest)
        check_model(ctx, req.model)
        prompts = await ctx.tokenization.encode_prompts(req.prompt, "prompt")
        return await _generate(ctx, request, req, prompts, arrival, chat=False, want_logprobs=req.logprobs is not None)

    @app.post("/v1/chat/completions", **documented(ChatCompletionRequest, OPENAI_RESPONSES["chat"]))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, ChatCompletionRequest)
        check_model(ctx, req.model)
        prompt = await ctx.tokenization.encode_chat(req)
        return await _generate(ctx, request, req, [prompt], arrival, chat=True, want_logprobs=req.logprobs)

    def model_card() -> dict:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.started_at,
            "owned_by": "radixserve",
            "root": ctx.model_dir,
            "max_model_len": ctx.context_len,
        }

    @app.get("/v1/models", **documented(None, OPENAI_RESPONSES["models"]))
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}", **documented(None, OPENAI_RESPONSES["model"]))
    async def model(model: str):
        check_model(ctx, model)
        return JSONResponse(model_card())
