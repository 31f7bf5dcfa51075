"""Request fields of structured outputs and tool calling (OpenAI's response_format, tools, tool_choice,
parallel_tool_calls, logit_bias; SGLang's regex and ebnf), as mixins that openai_schema's request models inherit,
and their translation into SamplingParams fields (`sampling_fields`).

Every check here needs only the body. Whether a grammar compiles is checked by structured_outputs.GrammarCheck.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from radixserve.grammar import JSON_OBJECT_SCHEMA
from radixserve.sampling import MAX_LOGIT_BIAS
from tokenizer_service.tool_calls import ToolChoice, check_tools, resolve_tool_choice, tool_choice_schema


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Fields):
    name: str | None = None
    description: str | None = None
    # Given as an object (OpenAI); a string is read as JSON text, so a schema that is not JSON is a clear 400.
    # ("schema" itself is a BaseModel attribute, hence the alias.)
    schema_: dict[str, Any] | str | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema object')
        return self


class _LogitBiasField(_Fields):
    logit_bias: dict[str, float] | None = None  # token id (as a JSON object key) -> bias in [-100, 100]

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to numbers")
        for key, bias in value.items():
            if not key.isdigit() or len(key) > 12:  # (int() refuses strings of over 4300 digits)
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"logit_bias[{key}] must be a number, got {bias!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {bias}")
        return {key: float(bias) for key, bias in value.items()}


class StructuredOutputFields(_LogitBiasField):
    """Constrained decoding and logit_bias, on both OpenAI routes."""

    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's extension
    ebnf: str | None = None  # SGLang's extension

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [
            name
            for name, on in (
                ("response_format", self._format_schema() is not None),
                ("regex", self.regex is not None),
                ("ebnf", self.ebnf is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise ValueError(
                f"only one of response_format (json), regex and ebnf may be given, got {' and '.join(given)}"
            )
        return self

    def _format_schema(self) -> str | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
            return JSON_OBJECT_SCHEMA
        schema = fmt.json_schema.schema_
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
            return schema
        return json.dumps(schema)


class NativeStructuredFields(_LogitBiasField):
    """The same in the native /generate sampling_params, with SGLang's names: json_schema is the schema's text."""

    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of json_schema, regex and ebnf may be given, got {' and '.join(given)}")
        return self


class FunctionCall(_Fields):
    name: str
    arguments: str


class AssistantToolCall(_Fields):
    """A tool call of an earlier assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(_Fields):
    """Tool calling, on /v1/chat/completions."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools(self):
        check_tools(self.tools or [])
        self.tool_choice_resolved  # raises ValueError naming the problem
        return self

    @property
    def tool_choice_resolved(self) -> ToolChoice:
        return resolve_tool_choice(self.tool_choice, self.tools)


class ChatStructuredFields(StructuredOutputFields, ToolFields):
    """Everything /v1/chat/completions takes. A forced tool_choice is a grammar of its own: it excludes the others."""

    @model_validator(mode="after")
    def _one_constraint(self):
        forced = self.tools and self.tool_choice_resolved.mode in ("required", "named")
        if forced and (self._format_schema() is not None or self.regex is not None or self.ebnf is not None):
            raise ValueError(
                "tool_choice 'required' or a named function cannot be combined with response_format "
                "(json), regex or ebnf"
            )
        return self


def sampling_fields(req) -> dict:
    """The SamplingParams fields (json_schema, regex, ebnf, logit_bias) of a request's structured-output and tool
    fields (the request, or /generate's sampling_params), for to_sampling_fields. tool_choice required or a named
    function becomes a JSON schema."""
    fields: dict[str, Any] = {}
    if isinstance(req, StructuredOutputFields):
        fields.update(json_schema=req._format_schema(), regex=req.regex, ebnf=req.ebnf)
        if req.logit_bias:
            fields["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if isinstance(req, NativeStructuredFields):
        fields.update(json_schema=req.json_schema, regex=req.regex, ebnf=req.ebnf)
        if req.logit_bias:
            fields["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if isinstance(req, ToolFields) and req.tools:
        forced = tool_choice_schema(req.tool_choice_resolved, req.tools, req.parallel_tool_calls)
        if forced is not None:
            fields["json_schema"] = forced
    return {k: v for k, v in fields.items() if v is not None}
