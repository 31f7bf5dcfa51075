"""The asyncio client of a radixserve server: Client's methods as coroutines, streams as async iterators. The
documentation is the package's (radixserve/client/__init__.py; `from radixserve.client import AsyncClient`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

import httpx

from radixserve.client.shared import DEFAULT_TIMEOUT_S, ClientBase, json_or_text
from radixserve.client.errors import RadixServeTimeoutError, error_from_response, transport_error
from radixserve.client.results import (
    AsyncStream,
    ChatResult,
    CompletionResult,
    GenerateResult,
    Model,
    NativeChunks,
    OpenAIChunks,
    StreamChunk,
    decode_event,
    parse_generate_body,
    parse_openai,
    sse_data,
)


class AsyncClient(ClientBase):
    """The asyncio twin of Client (same methods, awaited; streams are async iterators). Use `async with` or
    `await client.aclose()`."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:30000",
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
    ):
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.AsyncClient(headers=self._headers, timeout=self.timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # Transport ------------------------------------------------------------------------------------------
    async def _send(self, method: str, path: str, body: dict | None = None, timeout=None) -> httpx.Response:
        url = self._url(path)
        try:
            response = await self._http.request(method, url, json=body, timeout=self._request_timeout(timeout))
        except httpx.TransportError as e:
            raise transport_error(e, url) from e
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    async def _stream(
        self, path: str, body: dict, to_chunks: Callable[[dict], list[StreamChunk]], timeout
    ) -> AsyncStream:
        url = self._url(path)
        request = self._http.build_request("POST", url, json=body, timeout=self._request_timeout(timeout))
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise transport_error(e, url) from e
        if response.status_code >= 400:
            try:
                await response.aread()
            except httpx.TransportError:
                pass
            finally:
                await response.aclose()
            raise error_from_response(response)

        async def chunks() -> AsyncIterator[StreamChunk]:
            try:
                async for line in response.aiter_lines():
                    payload = sse_data(line)
                    if payload is None:
                        continue
                    data = decode_event(payload, response.status_code)
                    if data is None:
                        return
                    for chunk in to_chunks(data):
                        yield chunk
            except httpx.TransportError as e:
                raise transport_error(e, url) from e
            finally:
                await response.aclose()

        return AsyncStream(chunks())

    # OpenAI routes --------------------------------------------------------------------------------------
    async def chat(
        self,
        messages: list[dict],
        model: str | None = None,
        stream: bool = False,
        *,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        timeout: float | httpx.Timeout | None = None,
        **openai_params,
    ) -> ChatResult | AsyncStream:
        body = self._openai_body(
            "messages",
            messages,
            model,
            stream,
            openai_params,
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
        )
        if stream:
            return await self._stream("/v1/chat/completions", body, OpenAIChunks(chat=True), timeout)
        response = await self._send("POST", "/v1/chat/completions", body, timeout)
        return parse_openai(response.json(), chat=True)

    async def completions(
        self,
        prompt: str | list,
        model: str | None = None,
        stream: bool = False,
        *,
        response_format: dict | None = None,
        timeout: float | httpx.Timeout | None = None,
        **openai_params,
    ) -> CompletionResult | AsyncStream:
        body = self._openai_body("prompt", prompt, model, stream, openai_params, response_format=response_format)
        if stream:
            return await self._stream("/v1/completions", body, OpenAIChunks(chat=False), timeout)
        response = await self._send("POST", "/v1/completions", body, timeout)
        return parse_openai(response.json(), chat=False)

    # Native route ---------------------------------------------------------------------------------------
    async def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | None = None,
        stream: bool = False,
        *,
        timeout: float | httpx.Timeout | None = None,
        **extra,
    ) -> GenerateResult | list[GenerateResult] | AsyncStream:
        body = self._generate_body(text, input_ids, sampling_params, stream, extra)
        if stream:
            return await self._stream("/generate", body, NativeChunks(), timeout)
        return parse_generate_body((await self._send("POST", "/generate", body, timeout)).json())

    # Admin routes ---------------------------------------------------------------------------------------
    async def models(self) -> list[Model]:
        body = (await self._send("GET", "/v1/models")).json()
        return [Model(m.get("id", ""), m.get("owned_by"), m.get("max_model_len"), m) for m in body.get("data", [])]

    async def health(self, timeout: float | httpx.Timeout | None = None) -> bool:
        try:
            response = await self._http.get(self._url("/health"), timeout=self._request_timeout(timeout))
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise RadixServeTimeoutError(f"{self.base_url} not healthy after {timeout:.0f} s")
            await asyncio.sleep(interval)

    async def server_info(self) -> dict:
        return (await self._send("GET", "/server_info")).json()

    async def flush_cache(self, drop_pins: bool = False) -> Any:
        return json_or_text(await self._send("POST", self._flush_path(drop_pins)))

    async def pin_prefix(
        self,
        messages: list[dict] | None = None,
        prompt: str | list[int] | None = None,
        input_ids: list[int] | None = None,
        *,
        ttl_seconds: float | None = None,
        cache_salt: str | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> dict:
        body = self._pin_body(messages, prompt, input_ids, ttl_seconds, cache_salt)
        return (await self._send("POST", "/v1/cache/pin", body, timeout)).json()

    async def list_pins(self) -> list[dict]:
        return (await self._send("GET", "/v1/cache/pins")).json()["data"]

    async def unpin(self, pin_id: str) -> dict:
        return (await self._send("DELETE", self._unpin_path(pin_id))).json()

    async def metrics_text(self) -> str:
        return (await self._send("GET", "/metrics")).text
