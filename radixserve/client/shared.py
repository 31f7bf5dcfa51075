"""What Client (sync_client.py) and AsyncClient (async_client.py) share: the server's address,
key and timeouts, and the path and body of each route, built the same way whichever client sends them."""

from __future__ import annotations

import urllib.parse
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 60.0


def as_timeout(value: float | httpx.Timeout | None) -> httpx.Timeout:
    return value if isinstance(value, httpx.Timeout) else httpx.Timeout(value)


class ClientBase:
    """Base of Client and AsyncClient: everything but sending. The subclasses own the httpx client and the
    transport (_send, _stream), the one part that differs between blocking calls and coroutines."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float | httpx.Timeout | None):
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):  # accept the openai package's base_url too
            base_url = base_url[:-3]
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = as_timeout(timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # Request bodies -------------------------------------------------------------------------------------
    @staticmethod
    def _openai_body(key: str, value: Any, model: str | None, stream: bool, params: dict, **structured: Any) -> dict:
        """structured: response_format, tools, tool_choice (left out when None)."""
        body: dict[str, Any] = {key: value, **params, **{k: v for k, v in structured.items() if v is not None}}
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

    @staticmethod
    def _pin_body(messages, prompt, input_ids, ttl_seconds, cache_salt) -> dict:
        given = {
            k: v for k, v in (("messages", messages), ("prompt", prompt), ("input_ids", input_ids)) if v is not None
        }
        if len(given) != 1:
            raise ValueError("pass exactly one of messages, prompt and input_ids")
        body = dict(given)
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    @staticmethod
    def _unpin_path(pin_id: str) -> str:
        return "/v1/cache/pin/" + urllib.parse.quote(pin_id, safe="")

    @staticmethod
    def _flush_path(drop_pins: bool) -> str:
        return "/flush_cache?drop_pins=true" if drop_pins else "/flush_cache"

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _request_timeout(self, timeout: float | httpx.Timeout | None) -> httpx.Timeout:
        return self.timeout if timeout is None else as_timeout(timeout)


def json_or_text(response: httpx.Response) -> Any:
    """An admin route's answer as sent: JSON when it parses, else the text."""
    try:
        return response.json()
    except ValueError:
        return response.text
