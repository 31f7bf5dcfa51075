"""The synchronous client of a radixserve server (`Client`). The documentation is the package's,
radixserve/client/__init__.py."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import httpx

from radixserve.client.errors import RadixServeTimeoutError, error_from_response, transport_error
from radixserve.client.results import (
    ChatResult,
    CompletionResult,
    GenerateResult,
    Model,
    NativeChunks,
    OpenAIChunks,
    Stream,
    StreamChunk,
    decode_event,
    parse_generate_body,
    parse_openai,
    sse_data,
)
from radixserve.client.shared import DEFAULT_TIMEOUT_S, ClientBase, json_or_text


class Client(ClientBase):
    """Synchronous client. `timeout` (seconds, or an httpx.Timeout) bounds connecting and each wait for data;
    every method also takes `timeout=` for one call. Use as a context manager or call `close()`."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:30000",
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
    ):
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.Client(headers=self._headers, timeout=self.timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Transport ------------------------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: dict | None = None, timeout=None) -> httpx.Response:
        url = self._url(path)
        try:
            response = self._http.request(method, url, json=body, timeout=self._request_timeout(timeout))
        except httpx.TransportError as e:
            raise transport_error(e, url) from e
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _stream(self, path: str, body: dict, to_chunks: Callable[[dict], list[StreamChunk]], timeout) -> Stream:
        url = self._url(path)
        request = self._http.build_request("POST", url, json=body, timeout=self._request_timeout(timeout))
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise transport_error(e, url) from e
        if response.status_code >= 400:
            try:
                response.read()
            except httpx.TransportError:
                pass
            finally:
                response.close()
            raise error_from_response(response)

        def chunks() -> Iterator[StreamChunk]:
            try:
                for line in response.iter_lines():
                    payload = sse_data(line)
                    if payload is None:
                        continue
                    data = decode_event(payload, response.status_code)
                    if data is None:
                        return
                    yield from to_chunks(data)
            except httpx.TransportError as e:
                raise transport_error(e, url) from e
            finally:
                response.close()

        return Stream(chunks())

    # OpenAI routes --------------------------------------------------------------------------------------
    def chat(
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
    ) -> ChatResult | Stream:
        """POST /v1/chat/completions. openai_params: max_tokens, temperature, top_p, n, stop, seed, logprobs, ...,
        cache_salt (the tenant's cache namespace: cached prompts are shared only within one salt)."""
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
            return self._stream("/v1/chat/completions", body, OpenAIChunks(chat=True), timeout)
        return parse_openai(self._send("POST", "/v1/chat/completions", body, timeout).json(), chat=True)

    def completions(
        self,
        prompt: str | list,
        model: str | None = None,
        stream: bool = False,
        *,
        response_format: dict | None = None,
        timeout: float | httpx.Timeout | None = None,
        **openai_params,
    ) -> CompletionResult | Stream:
        """POST /v1/completions. prompt: a string, a list of strings, token ids or a list of token-id lists."""
        body = self._openai_body("prompt", prompt, model, stream, openai_params, response_format=response_format)
        if stream:
            return self._stream("/v1/completions", body, OpenAIChunks(chat=False), timeout)
        return parse_openai(self._send("POST", "/v1/completions", body, timeout).json(), chat=False)

    # Native route ---------------------------------------------------------------------------------------
    def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | None = None,
        stream: bool = False,
        *,
        timeout: float | httpx.Timeout | None = None,
        **extra,
    ) -> GenerateResult | list[GenerateResult] | Stream:
        """POST /generate. sampling_params uses SGLang's names (max_new_tokens, temperature, top_p, top_k, min_p,
        stop, stop_token_ids, seed, ignore_eos, ...); extra top-level fields (return_logprob, cache_salt, ...) go
        as they are.
        A list of prompts gives a list of results."""
        body = self._generate_body(text, input_ids, sampling_params, stream, extra)
        if stream:
            return self._stream("/generate", body, NativeChunks(), timeout)
        return parse_generate_body(self._send("POST", "/generate", body, timeout).json())

    # Admin routes ---------------------------------------------------------------------------------------
    def models(self) -> list[Model]:
        body = self._send("GET", "/v1/models").json()
        return [Model(m.get("id", ""), m.get("owned_by"), m.get("max_model_len"), m) for m in body.get("data", [])]

    def health(self, timeout: float | httpx.Timeout | None = None) -> bool:
        """True when GET /health answers 200; False for any other answer or no answer at all."""
        try:
            response = self._http.get(self._url("/health"), timeout=self._request_timeout(timeout))
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.2) -> None:
        """Poll /health until it answers 200; RadixServeTimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise RadixServeTimeoutError(f"{self.base_url} not healthy after {timeout:.0f} s")
            time.sleep(interval)

    def server_info(self) -> dict:
        return self._send("GET", "/server_info").json()

    def flush_cache(self, drop_pins: bool = False) -> Any:
        """POST /flush_cache; the server's answer (JSON if it sent JSON, else text). Pinned prefixes stay cached
        unless drop_pins."""
        return json_or_text(self._send("POST", self._flush_path(drop_pins)))

    # Pinned prefixes -------------------------------------------------------------------------------------
    def pin_prefix(
        self,
        messages: list[dict] | None = None,
        prompt: str | list[int] | None = None,
        input_ids: list[int] | None = None,
        *,
        ttl_seconds: float | None = None,
        cache_salt: str | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> dict:
        """POST /v1/cache/pin: keep a prefix cached (computed first if it is not) until unpinned or ttl_seconds
        pass. messages are rendered without the generation prompt. Returns the pin (id, num_tokens, cache_salt,
        created_at, expires_at, pinned_tokens); a RadixServeError with status 409 past --max-pinned-tokens."""
        body = self._pin_body(messages, prompt, input_ids, ttl_seconds, cache_salt)
        return self._send("POST", "/v1/cache/pin", body, timeout).json()

    def list_pins(self) -> list[dict]:
        """GET /v1/cache/pins: every pin, as pin_prefix returns them."""
        return self._send("GET", "/v1/cache/pins").json()["data"]

    def unpin(self, pin_id: str) -> dict:
        """DELETE /v1/cache/pin/{pin_id}; a RadixServeError with status 404 for an unknown (or expired) pin."""
        return self._send("DELETE", self._unpin_path(pin_id)).json()

    def metrics_text(self) -> str:
        """GET /metrics: the Prometheus text exposition."""
        return self._send("GET", "/metrics").text
