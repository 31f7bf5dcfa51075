"""HTTP helpers of the pinned-prefix tests (one replica and data-parallel): prompts that share nothing, a prompt's
cached token count, pin and list."""

from __future__ import annotations

import httpx


def prompt_ids(first: int, n: int) -> list[int]:
    """n token ids starting with 100 + `first`: prompts that start differently share nothing in the tree (and
    nothing with a chat prompt, which starts with a special token below 100)."""
    return [100 + first] + [1000 + (first * 7 + i * 13) % 40000 for i in range(n - 1)]


def cached_tokens(http: httpx.Client, prompt: list[int], **fields) -> int:
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def pin(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/cache/pin", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def pins(http: httpx.Client) -> dict[str, dict]:
    response = http.get("/v1/cache/pins")
    assert response.status_code == 200, response.text
    return {p["id"]: p for p in response.json()["data"]}
