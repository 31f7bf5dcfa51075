"""Python client for a radixserve server: the OpenAI routes, the native /generate route and the admin routes, over
httpx, with typed results, streaming iterators and errors that carry the server's message.

```python
from radixserve.client import Client
client = Client("http://127.0.0.1:30000")
reply = client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0)
print(reply.text)
```

`AsyncClient` has the same methods as coroutines; its streaming methods return async iterators.

Streaming (`stream=True`) returns a `Stream` of `StreamChunk`s, each with the new text (`.text`, a delta, never
cumulative). The last chunks carry `finish_reason` and, where the server reports it, `usage`: for the OpenAI routes
the client asks for `stream_options={"include_usage": True}` unless you pass your own `stream_options`. Leaving a
stream early (break, `close()`, the `with` block ending) closes the connection, and the server aborts the request.

Errors:
    RadixServeError            the server answered 4xx/5xx (status_code, message, type, param, code, body), or sent
                               an error inside a stream; base class of the two below
    RadixServeConnectionError  no connection (server down, wrong URL), or it broke mid-response
    RadixServeTimeoutError     no answer within the timeout (connect, or the next bytes of a response)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import httpx

__all__ = [
    "AsyncClient", "AsyncStream", "ChatResult", "Choice", "Client", "CompletionResult", "GenerateResult",
    "Model", "RadixServeConnectionError", "RadixServeError", "RadixServeTimeoutError", "Stream", "StreamChunk",
    "Usage",
]

DEFAULT_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------------- errors


class RadixServeError(Exception):
    """An error answer of the server (status_code set) or a failure to reach it (status_code None)."""

    def __init__(self, status_code: int | None, message: str, type: str | None = None, param: str | None = None,
                 code: Any = None, body: Any = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body = body  # the parsed JSON (or text) of the error response

    def __str__(self) -> str:
        where = f"HTTP {self.status_code}" if self.status_code is not None else (self.type or "error")
        extra = f" (param: {self.param})" if self.param else ""
        return f"{where}: {self.message}{extra}"


class RadixServeConnectionError(RadixServeError):
    """Could not connect to the server, or the connection broke before the response was complete."""

    def __init__(self, message: str):
        super().__init__(None, message, type="connection_error")


class RadixServeTimeoutError(RadixServeError):
    """The server did not answer (or send the next part of a response) within the timeout."""

    def __init__(self, message: str):
        super().__init__(None, message, type="timeout")


def _error_from_body(status_code: int | None, body: Any) -> RadixServeError:
    """The OpenAI error shape {"error": {"message", "type", "param", "code"}}, FastAPI's {"detail": ...}, or
    anything else (shown as it came)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = err.get("code")
        if status_code is None and isinstance(code, int):
            status_code = code
        return RadixServeError(status_code, str(err.get("message") or err), err.get("type"), err.get("param"),
                               code, body)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return RadixServeError(status_code, body["error"], body.get("type"), body.get("param"), body.get("code"),
                               body)
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return RadixServeError(status_code, detail if isinstance(detail, str) else json.dumps(detail), body=body)
    text = body if isinstance(body, str) else json.dumps(body)
    return RadixServeError(status_code, text or f"HTTP {status_code}", body=body)


def _error_from_response(response: httpx.Response) -> RadixServeError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return _error_from_body(response.status_code, body)


def _transport_error(exc: httpx.TransportError, url: str) -> RadixServeError:
    if isinstance(exc, httpx.TimeoutException):
        return RadixServeTimeoutError(f"timed out waiting for {url} ({type(exc).__name__}: {exc})")
    if isinstance(exc, httpx.ConnectError):
        return RadixServeConnectionError(f"could not connect to {url}: {exc} (is the server running?)")
    return RadixServeConnectionError(f"connection to {url} failed: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the radix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_openai(cls, usage: dict | None) -> "Usage | None":
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                   details.get("cached_tokens", 0) or 0)


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None  # "stop" | "length"
    logprobs: Any = None
    stop_reason: int | str | None = None  # the stop string or token id that matched, when the server says


@dataclass
class CompletionResult:
    """A /v1/completions answer; `text` and `finish_reason` are the first choice's."""
    text: str
    finish_reason: str | None
    usage: Usage
    choices: list[Choice]
    model: str | None = None
    id: str | None = None
    raw: dict = field(default_factory=dict, repr=False)


@dataclass
class ChatResult(CompletionResult):
    """A /v1/chat/completions answer; `text` and `finish_reason` are the first choice's."""


@dataclass
class GenerateResult:
    """A native /generate answer. finish_reason is "stop" or "length"; matched_stop the stop token id or string."""
    text: str
    output_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None
    index: int = 0
    meta_info: dict = field(default_factory=dict, repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass
class StreamChunk:
    """One piece of a streamed answer: `text` is new text only. For /v1/* streams with several choices, `index`
    says which; the usage chunk has text "" and `usage` set. For /generate, `output_ids` are the new token ids
    and the finished chunk carries `usage` (prompt, completion and cached tokens) and `matched_stop`."""
    text: str
    index: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    output_ids: list[int] = field(default_factory=list)
    role: str | None = None
    logprobs: Any = None
    matched_stop: int | str | None = None
    raw: dict = field(default_factory=dict, repr=False)


@dataclass
class Model:
    id: str
    owned_by: str | None = None
    max_model_len: int | None = None
    raw: dict = field(default_factory=dict, repr=False)


# ------------------------------------------------------------------------------------------------ parsing


def _parse_choices(body: dict, chat: bool) -> list[Choice]:
    choices = []
    for c in body.get("choices") or []:
        text = ((c.get("message") or {}).get("content") if chat else c.get("text")) or ""
        choices.append(Choice(c.get("index", 0), text, c.get("finish_reason"), c.get("logprobs"),
                              c.get("stop_reason")))
    return sorted(choices, key=lambda c: c.index)


def _parse_openai(body: dict, chat: bool):
    choices = _parse_choices(body, chat)
    first = choices[0] if choices else Choice(0, "", None)
    cls = ChatResult if chat else CompletionResult
    return cls(first.text, first.finish_reason, Usage.from_openai(body.get("usage")) or Usage(), choices,
               body.get("model"), body.get("id"), body)


def _native_finish(meta: dict) -> tuple[str | None, int | str | None]:
    """SGLang's finish_reason {"type": "stop", "matched": x} / {"type": "length", ...}, or a plain string."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type"), reason.get("matched")
    return reason, None


def _parse_generate(body: dict) -> GenerateResult:
    meta = body.get("meta_info") or {}
    reason, matched = _native_finish(meta)
    output_ids = list(body.get("output_ids") or [])
    return GenerateResult(body.get("text", ""), output_ids, reason, meta.get("prompt_tokens", 0),
                          meta.get("completion_tokens", len(output_ids)), meta.get("cached_tokens", 0) or 0,
                          matched, body.get("index", 0), meta, body)


def _parse_generate_body(body: Any) -> GenerateResult | list[GenerateResult]:
    if isinstance(body, list):  # a batch: a list of texts or of token-id lists
        return [_parse_generate(b) for b in body]
    return _parse_generate(body)


class _OpenAIChunks:
    """Turns the data objects of a /v1/* SSE stream into StreamChunks."""

    def __init__(self, chat: bool):
        self.chat = chat

    def __call__(self, data: dict) -> list[StreamChunk]:
        out = []
        for c in data.get("choices") or []:
            if self.chat:
                delta = c.get("delta") or {}
                text, role = delta.get("content") or "", delta.get("role")
            else:
                text, role = c.get("text") or "", None
            out.append(StreamChunk(text, c.get("index", 0), c.get("finish_reason"), None, role=role,
                                   logprobs=c.get("logprobs"), matched_stop=c.get("stop_reason"), raw=data))
        usage = Usage.from_openai(data.get("usage"))
        if usage is not None:
            if out:
                out[-1].usage = usage
            else:
                out.append(StreamChunk("", usage=usage, raw=data))
        return out


class _NativeChunks:
    """Turns the data objects of a /generate SSE stream into StreamChunks with delta text and ids.

    Each data object has the shape of a /generate result carrying the text and output_ids of its choice so far
    (cumulative, as radixserve and SGLang send them); the new part is what follows the previous chunk of the same
    index. A chunk that does not extend the previous one (a server sending deltas) is taken as a delta."""

    def __init__(self):
        self._text: dict[int, str] = {}
        self._ids: dict[int, list[int]] = {}

    def __call__(self, data: dict) -> list[StreamChunk]:
        index = data.get("index", 0)
        meta = data.get("meta_info") or {}
        text, ids = data.get("text") or "", list(data.get("output_ids") or [])
        seen_text, seen_ids = self._text.get(index, ""), self._ids.get(index, [])
        if text.startswith(seen_text) and ids[:len(seen_ids)] == seen_ids:
            new_text, new_ids = text[len(seen_text):], ids[len(seen_ids):]
        else:
            new_text, new_ids = text, ids
        self._text[index], self._ids[index] = seen_text + new_text, seen_ids + new_ids
        reason, matched = _native_finish(meta)
        usage = None
        if reason is not None:
            usage = Usage(meta.get("prompt_tokens", 0), len(self._ids[index]), meta.get("cached_tokens", 0) or 0)
        return [StreamChunk(new_text, index, reason, usage, new_ids, matched_stop=matched, raw=data)]


def _sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _decode_event(payload: str, status_code: int) -> dict | None:
    """The JSON object of one SSE event; None at [DONE]; raises for an error event."""
    if payload == "[DONE]":
        return None
    try:
        data = json.loads(payload)
    except ValueError as e:
        raise RadixServeError(status_code, f"the server sent a malformed stream event: {payload[:200]!r}",
                              type="stream_error") from e
    if isinstance(data, dict) and "error" in data and not data.get("choices") and "text" not in data:
        raise _error_from_body(None, data)
    return data


# ------------------------------------------------------------------------------------------------ streams


class Stream:
    """An iterator of StreamChunks over an open HTTP response; closes it when exhausted, on `close()`, when the
    `with` block ends or when garbage-collected."""

    def __init__(self, chunks: Iterator[StreamChunk]):
        self._chunks = chunks

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]  # a generator: runs its finally (closes the response)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    """The async twin of Stream: `async for chunk in stream`, `await stream.aclose()`, `async with`."""

    def __init__(self, chunks: AsyncIterator[StreamChunk]):
        self._chunks = chunks

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


# ------------------------------------------------------------------------------------------------ clients


def _timeout(value: float | httpx.Timeout | None) -> httpx.Timeout:
    return value if isinstance(value, httpx.Timeout) else httpx.Timeout(value)


class _Base:
    def __init__(self, base_url: str, api_key: str | None, timeout: float | httpx.Timeout | None):
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):  # accept the openai package's base_url too
            base_url = base_url[:-3]
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = _timeout(timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # Request bodies -------------------------------------------------------------------------------------
    @staticmethod
    def _openai_body(key: str, value: Any, model: str | None, stream: bool, params: dict) -> dict:
        body: dict[str, Any] = {key: value, **params}
        if model is not None:
            body["model"] = model
        if stream:
            body["stream"] = True
            body.setdefault("stream_options", {"include_usage": True})
        return body

    @staticmethod
    def _generate_body(text, input_ids, sampling_params, stream: bool, extra: dict) -> dict:
        if (text is None) == (input_ids is None):
            raise ValueError("pass exactly one of text and input_ids")
        body: dict[str, Any] = {"text": text} if text is not None else {"input_ids": input_ids}
        body["sampling_params"] = dict(sampling_params or {})
        if stream:
            body["stream"] = True
        body.update(extra)
        return body

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _request_timeout(self, timeout: float | httpx.Timeout | None) -> httpx.Timeout:
        return self.timeout if timeout is None else _timeout(timeout)


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


class Client(_Base):
    """Synchronous client. `timeout` (seconds, or an httpx.Timeout) bounds connecting and each wait for data;
    every method also takes `timeout=` for one call. Use as a context manager or call `close()`."""

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S):
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
            raise _transport_error(e, url) from e
        if response.status_code >= 400:
            raise _error_from_response(response)
        return response

    def _stream(self, path: str, body: dict, to_chunks: Callable[[dict], list[StreamChunk]], timeout) -> Stream:
        url = self._url(path)
        request = self._http.build_request("POST", url, json=body, timeout=self._request_timeout(timeout))
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise _transport_error(e, url) from e
        if response.status_code >= 400:
            try:
                response.read()
            except httpx.TransportError:
                pass
            finally:
                response.close()
            raise _error_from_response(response)

        def chunks() -> Iterator[StreamChunk]:
            try:
                for line in response.iter_lines():
                    payload = _sse_data(line)
                    if payload is None:
                        continue
                    data = _decode_event(payload, response.status_code)
                    if data is None:
                        return
                    yield from to_chunks(data)
            except httpx.TransportError as e:
                raise _transport_error(e, url) from e
            finally:
                response.close()

        return Stream(chunks())

    # OpenAI routes --------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], model: str | None = None, stream: bool = False, *,
             timeout: float | httpx.Timeout | None = None, **openai_params) -> ChatResult | Stream:
        """POST /v1/chat/completions. openai_params: max_tokens, temperature, top_p, n, stop, seed, logprobs, ..."""
        body = self._openai_body("messages", messages, model, stream, openai_params)
        if stream:
            return self._stream("/v1/chat/completions", body, _OpenAIChunks(chat=True), timeout)
        return _parse_openai(self._send("POST", "/v1/chat/completions", body, timeout).json(), chat=True)

    def completions(self, prompt: str | list, model: str | None = None, stream: bool = False, *,
                    timeout: float | httpx.Timeout | None = None, **openai_params) -> CompletionResult | Stream:
        """POST /v1/completions. prompt: a string, a list of strings, token ids or a list of token-id lists."""
        body = self._openai_body("prompt", prompt, model, stream, openai_params)
        if stream:
            return self._stream("/v1/completions", body, _OpenAIChunks(chat=False), timeout)
        return _parse_openai(self._send("POST", "/v1/completions", body, timeout).json(), chat=False)

    # Native route ---------------------------------------------------------------------------------------
    def generate(self, text: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | None = None, stream: bool = False, *,
                 timeout: float | httpx.Timeout | None = None,
                 **extra) -> GenerateResult | list[GenerateResult] | Stream:
        """POST /generate. sampling_params uses SGLang's names (max_new_tokens, temperature, top_p, top_k, min_p,
        stop, stop_token_ids, seed, ignore_eos, ...); extra top-level fields (return_logprob, ...) go as they are.
        A list of prompts gives a list of results."""
        body = self._generate_body(text, input_ids, sampling_params, stream, extra)
        if stream:
            return self._stream("/generate", body, _NativeChunks(), timeout)
        return _parse_generate_body(self._send("POST", "/generate", body, timeout).json())

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

    def flush_cache(self) -> Any:
        """POST /flush_cache; the server's answer (JSON if it sent JSON, else text)."""
        return _json_or_text(self._send("POST", "/flush_cache"))

    def metrics_text(self) -> str:
        """GET /metrics: the Prometheus text exposition."""
        return self._send("GET", "/metrics").text


class AsyncClient(_Base):
    """The asyncio twin of Client (same methods, awaited; streams are async iterators). Use `async with` or
    `await client.aclose()`."""

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S):
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
            raise _transport_error(e, url) from e
        if response.status_code >= 400:
            raise _error_from_response(response)
        return response

    async def _stream(self, path: str, body: dict, to_chunks: Callable[[dict], list[StreamChunk]],
                      timeout) -> AsyncStream:
        url = self._url(path)
        request = self._http.build_request("POST", url, json=body, timeout=self._request_timeout(timeout))
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise _transport_error(e, url) from e
        if response.status_code >= 400:
            try:
                await response.aread()
            except httpx.TransportError:
                pass
            finally:
                await response.aclose()
            raise _error_from_response(response)

        async def chunks() -> AsyncIterator[StreamChunk]:
            try:
                async for line in response.aiter_lines():
                    payload = _sse_data(line)
                    if payload is None:
                        continue
                    data = _decode_event(payload, response.status_code)
                    if data is None:
                        return
                    for chunk in to_chunks(data):
                        yield chunk
            except httpx.TransportError as e:
                raise _transport_error(e, url) from e
            finally:
                await response.aclose()

        return AsyncStream(chunks())

    # OpenAI routes --------------------------------------------------------------------------------------
    async def chat(self, messages: list[dict], model: str | None = None, stream: bool = False, *,
                   timeout: float | httpx.Timeout | None = None, **openai_params) -> ChatResult | AsyncStream:
        body = self._openai_body("messages", messages, model, stream, openai_params)
        if stream:
            return await self._stream("/v1/chat/completions", body, _OpenAIChunks(chat=True), timeout)
        response = await self._send("POST", "/v1/chat/completions", body, timeout)
        return _parse_openai(response.json(), chat=True)

    async def completions(self, prompt: str | list, model: str | None = None, stream: bool = False, *,
                          timeout: float | httpx.Timeout | None = None,
                          **openai_params) -> CompletionResult | AsyncStream:
        body = self._openai_body("prompt", prompt, model, stream, openai_params)
        if stream:
            return await self._stream("/v1/completions", body, _OpenAIChunks(chat=False), timeout)
        response = await self._send("POST", "/v1/completions", body, timeout)
        return _parse_openai(response.json(), chat=False)

    # Native route ---------------------------------------------------------------------------------------
    async def generate(self, text: str | list[str] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, sampling_params: dict | None = None,
                       stream: bool = False, *, timeout: float | httpx.Timeout | None = None,
                       **extra) -> GenerateResult | list[GenerateResult] | AsyncStream:
        body = self._generate_body(text, input_ids, sampling_params, stream, extra)
        if stream:
            return await self._stream("/generate", body, _NativeChunks(), timeout)
        return _parse_generate_body((await self._send("POST", "/generate", body, timeout)).json())

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

    async def flush_cache(self) -> Any:
        return _json_or_text(await self._send("POST", "/flush_cache"))

    async def metrics_text(self) -> str:
        return (await self._send("GET", "/metrics")).text
