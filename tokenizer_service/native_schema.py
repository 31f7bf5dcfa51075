"""Request body of the native POST /generate (SGLang's names), with validation.

Strict like the OpenAI models (openai_schema.py); unknown fields are ignored, except in `sampling_params`, where a
typo would silently change sampling.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from tokenizer_service.request_fields import _check_cache_salt
from tokenizer_service.request_fields import (
    DEFAULT_NATIVE_MAX_NEW_TOKENS,
    _check_logprobs_count,
    _check_max_tokens,
    _check_min_tokens,
    _check_priority,
    _check_prompt,
    _SamplingFields,
    _StrictModel,
)
from tokenizer_service.structured_fields import NativeStructuredFields


class NativeSamplingParams(_SamplingFields, NativeStructuredFields):
    """`sampling_params` of POST /generate, with SGLang's names."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = DEFAULT_NATIVE_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    # SGLang's name (sglang-router and SGLang clients send it): keep the matched stop string in the output.
    no_stop_trim: bool = False

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, value: int | None) -> int | None:
        return _check_max_tokens("max_new_tokens", value)

    @field_validator("min_new_tokens")
    @classmethod
    def _min_new_tokens(cls, value: int) -> int:
        return _check_min_tokens("min_new_tokens", value)

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        return self


class GenerateRequest(_StrictModel):
    """POST /generate (native): exactly one of `text` and `input_ids`."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    priority: int = 0  # SGLang's field: admission order with --enable-priority-scheduling

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: int) -> int:
        return _check_priority("priority", value)

    cache_salt: str | None = None  # tenant isolation in the prefix cache, as on the OpenAI routes

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, value: Any) -> Any:
        return _check_cache_salt(value)

    @field_validator("text", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return None if value is None else _check_prompt("text", value, allow_ids=False)

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, value: Any) -> Any:
        return None if value is None else _check_prompt("input_ids", value, allow_text=False)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sampling_params(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_logprobs_num(cls, value: int) -> int:
        return _check_logprobs_count("top_logprobs_num", value)

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        return self
