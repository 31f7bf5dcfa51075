"""Field validation shared by the request models of openai_schema.py (OpenAI routes) and native_schema.py
(native /generate): limits, prompt and token-id checks, the strict base model and the sampling fields both accept.

Every check here needs only the body; checks that need the model (vocabulary size, context length, model name)
belong to the server. Error messages name the field and the allowed range, because clients show them verbatim.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

MAX_N = 16  # choices per request; each one is a sequence in the batch and holds KV
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit for chat)
MAX_STOP_STRINGS = 64  # every stop string is checked on every generated token
MAX_CACHE_SALT_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# chat_template_kwargs a request may set: harmless switches that chat templates read (Qwen3, DeepSeek).
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "add_generation_prompt"})

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_NATIVE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate


# ------------------------------------------------------------------------------ field checks


def _check_token_ids(name: str, ids: list) -> list[int]:
    # bool is an int subclass in Python; JSON true/false is never a token id.
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{name} must contain only integer token ids, got {token!r}")
        if token < 0:
            raise ValueError(f"{name} must contain only non-negative token ids, got {token}")
    return ids


def _check_prompt(name: str, value: Any, allow_text: bool = True, allow_ids: bool = True):
    """Accepts the OpenAI prompt shapes: str, list[str], list[int], list[list[int]], none empty."""
    shapes = []
    if allow_text:
        shapes += ["a string", "a list of strings"]
    if allow_ids:
        shapes += ["a list of token ids", "a list of token-id lists"]
    shape_error = ValueError(f"{name} must be {', '.join(shapes[:-1])} or {shapes[-1]}")

    if isinstance(value, str):
        if not allow_text:
            raise shape_error
        if not value:
            raise ValueError(f"{name} must not be empty")
        return value
    if not isinstance(value, list):
        raise shape_error
    if not value:
        raise ValueError(f"{name} must not be empty")
    if allow_text and all(isinstance(item, str) for item in value):
        if any(not item for item in value):
            raise ValueError(f"{name} must not contain empty strings")
        return value
    if allow_ids and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return _check_token_ids(name, value)
    if allow_ids and all(isinstance(item, list) for item in value):
        for ids in value:
            if not ids:
                raise ValueError(f"{name} must not contain empty token-id lists")
            _check_token_ids(name, ids)
        return value
    raise shape_error


def _check_cache_salt(value: Any) -> Any:
    """cache_salt: the tenant's cache namespace (requests share cached prompts only with the same salt). Any
    non-empty string; it is compared, never shown, so its length is bounded only to keep messages small."""
    if value is None:
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("cache_salt must be a non-empty string")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
    return value


def _check_max_tokens(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _check_min_tokens(name: str, value: int) -> int:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_priority(name: str, value: int) -> int:
    # Bounded so that it fits the socket message's integers; the server refuses a non-zero one unless
    # --enable-priority-scheduling (serving.check_priority).
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} must fit in a signed 32-bit integer, got {value}")
    return value


def _check_logprobs_count(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
    return value


# ------------------------------------------------------------------------------------ models


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictModel):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool = False


class _SamplingFields(_StrictModel):
    """Sampling fields shared by the OpenAI routes and the native sampling_params."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM extension; False shows e.g. <|im_end|> in the text

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not (0 < value <= 1):  # NaN fails both comparisons
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not (0 <= value <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if not 1 <= value <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may contain at most {MAX_STOP_STRINGS} strings, got {len(value)}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        return _check_token_ids("stop_token_ids", value)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _additive_penalty(cls, value: float, info) -> float:
        if not (-2 <= value <= 2):
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {value}")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float) -> float:
        # Same range as radixserve.sampling.SamplingParams.validate, so nothing passes here and fails there.
        if not (0 < value <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {value}")
        return value
