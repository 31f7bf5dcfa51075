"""OpenAI error bodies, and the one-sentence messages a pydantic ValidationError of a request body becomes.

Error messages name the field and the allowed range, because clients show them to people verbatim.
"""

from __future__ import annotations

from pydantic import ValidationError


def openai_error(message: str, type: str = "invalid_request_error", param: str | None = None, code: int = 400) -> dict:
    """The body of an OpenAI error response: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _format_loc(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, str) and (not part.isidentifier() or part in _UNION_MEMBER_TAGS):
            continue  # pydantic's tag of a union member, e.g. "list[TextContentPart]"
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error_param(exc: ValidationError) -> str | None:
    """The top-level request field of the first error (OpenAI's `param`), or None for the whole body."""
    errors = exc.errors()
    if not errors or not errors[0]["loc"]:
        return None
    return str(errors[0]["loc"][0])


def validation_error_message(exc: ValidationError) -> str:
    """One readable sentence for the first error, naming the field, e.g.
    "temperature must be a finite number >= 0, got nan" or "messages[0].role: Input should be ...".
    """
    errors = exc.errors()
    if not errors:
        return "Invalid request"
    error = errors[0]
    loc, kind = error["loc"], error["type"]
    path = _format_loc(loc)
    if kind == "value_error":
        # Our own validators write complete sentences that name the field already.
        message = str(error["ctx"]["error"]) if "ctx" in error else error["msg"].removeprefix("Value error, ")
        return message if len(loc) <= 1 else f"{path}: {message}"
    if kind == "missing":
        return f"'{path}' is a required field"
    if kind == "extra_forbidden":
        return f"'{path}' is not a recognised field"
    if kind == "json_invalid":
        return f"Request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    if not loc:
        if kind in ("model_type", "dict_type", "model_attributes_type"):
            return "Request body must be a JSON object"
        return error["msg"]
    return f"{path}: {error['msg']}"


def openai_error_from_validation(exc: ValidationError) -> dict:
    return openai_error(validation_error_message(exc), param=validation_error_param(exc))
