"""POST /v1/tokenize and /v1/detokenize, with vLLM's request and response shapes (also served at /tokenize and
/detokenize, vLLM's paths): a prompt, or chat messages rendered by the server's chat template exactly as
/v1/chat/completions renders them, to token ids; token ids back to text. Nothing reaches the scheduler.

Tokenizing runs in the tokenizer thread pool (tokenization.py), like every prompt of a generating route, so a long
text never stalls the event loop; the same character bound refuses a text no context could hold."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from tokenizer_service.errors import JSONResponse, RequestError
from tokenizer_service.openai_schema import ChatCompletionRequest, ChatMessage, openai_error_from_validation
from tokenizer_service.openapi_docs import _ok, documented
from tokenizer_service.request_fields import _check_token_ids, _StrictModel
from tokenizer_service.serving import ServingContext, check_model, parse_body


class TokenizeRequest(_StrictModel):
    """Exactly one of `prompt` (text) and `messages` (a chat, through the server's chat template)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # prompt only: BOS and the like, as a completion's prompt gets them
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on /v1/chat/completions: the last message left open
    chat_template_kwargs: dict[str, bool] | None = None  # checked as /v1/chat/completions checks it
    tools: list[dict[str, Any]] | None = None  # rendered as the chat route renders them
    return_token_strs: bool = False  # also each token's piece of the vocabulary (vLLM's token_strs)

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        return self


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError("tokens must be a list of token ids")
        return _check_token_ids("tokens", value)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


def _chat_request(req: TokenizeRequest) -> ChatCompletionRequest:
    """The chat part of the body as a chat completion request, through the chat route's own validation."""
    fields = req.model_dump(
        include={"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"},
        exclude_none=True,
    )
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        error = openai_error_from_validation(e)["error"]
        raise RequestError(error["message"], param=error["param"]) from None


def add_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    tokenize_doc = documented(TokenizeRequest, {200: _ok(TokenizeResponse.model_json_schema(), "The token ids")})
    detokenize_doc = documented(DetokenizeRequest, {200: _ok(DetokenizeResponse.model_json_schema(), "The text")})

    async def tokenize(request: Request):
        req = await parse_body(request, TokenizeRequest)
        check_model(ctx, req.model)
        if req.messages is not None:
            tokens = await ctx.tokenization.encode_chat(_chat_request(req))
        else:
            tokens = await ctx.tokenization.encode_text(req.prompt, req.add_special_tokens, "prompt")
        token_strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": ctx.context_len, "tokens": tokens, "token_strs": token_strs}
        )

    async def detokenize(request: Request):
        req = await parse_body(request, DetokenizeRequest)
        check_model(ctx, req.model)
        outside = [t for t in req.tokens if t >= ctx.vocab_size]
        if outside:
            raise RequestError(
                f"tokens contains {outside[0]}, outside the vocabulary [0, {ctx.vocab_size})", param="tokens"
            )
        return JSONResponse({"prompt": await ctx.tokenization.decode(req.tokens)})

    for path in ("/v1/tokenize", "/tokenize"):
        app.post(path, **tokenize_doc)(tokenize)
    for path in ("/v1/detokenize", "/detokenize"):
        app.post(path, **detokenize_doc)(detokenize)
