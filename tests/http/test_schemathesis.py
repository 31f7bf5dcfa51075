"""Property-based API testing with schemathesis against the server's own /openapi.json (a real `launch.py`
subprocess, tiny model): over 1,000 generated requests across every route, no 5xx, and every response's status,
content type, headers and body as the description documents them.

The description is used as served, narrowed in two ways so that the run stays short on two CPU cores: generation
lengths (max_tokens and friends, n) are capped at a few tokens and made explicit, and `model` is the served name
(other names are a documented 404, which would otherwise take most of the budget). Malformed and out-of-range input
is covered case by case in test_bad_inputs.py. JSON numbers like 2.0 where an integer is documented are sent as 2
(see integral_floats_as_ints).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import checks as sc

from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL = tiny_model_dir("llama").name  # the served name: the model directory's, launch.py's default
MAX_GENERATED = 2
# Examples per operation (hypothesis stops earlier on a route with nothing to vary, like GET /health). The chat route's
# request schema (messages of every content-part type, tools) is the slowest to draw, ~35 ms a case against 5-10 ms for
# the others, and 9 in 10 of its cases are 400s: it gets half the budget of the other generating routes.
BUDGET = {
    "POST /v1/completions": 260,
    "POST /v1/chat/completions": 130,
    "POST /generate": 260,
    "GET /v1/models/{model}": 250,
    "GET /v1/models": 5,
    "GET /health": 5,
    "GET /server_info": 5,
    "GET /metrics": 5,
    "POST /flush_cache": 5,
    "POST /v1/tokenize": 40,
    "POST /v1/detokenize": 40,
    "POST /tokenize": 10,
    "POST /detokenize": 10,
    "POST /v1/responses": 200,
    "GET /v1/responses/{response_id}": 25,
    "DELETE /v1/responses/{response_id}": 25,
}
MIN_CASES = 1000
CLIENTS = 32
CHECKS = [
    sc.not_a_server_error,
    sc.status_code_conformance,
    sc.content_type_conformance,
    sc.response_headers_conformance,
    sc.response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server  # shared with other modules (tests/conftest.py)


def bounded_length(schema: dict) -> None:
    schema.clear()
    schema.update({"type": "integer", "minimum": 1, "maximum": MAX_GENERATED})


def integral_floats_as_ints(value):
    """JSON Schema lets 2.0 be an "integer"; the server's strict types refuse it (a documented 400, covered in
    test_bad_inputs.py). Sent as 2, such a case tests something instead."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    return value


def narrow(raw: dict) -> dict:
    schemas = raw["components"]["schemas"]
    for name, lengths in (
        ("CompletionRequest", ["max_tokens"]),
        ("ChatCompletionRequest", ["max_tokens", "max_completion_tokens"]),
        ("NativeSamplingParams", ["max_new_tokens"]),
        ("ResponsesRequest", ["max_output_tokens"]),
    ):
        model = schemas[name]
        for field in lengths:
            bounded_length(model["properties"][field])
            model.setdefault("required", []).append(field)
        if "n" in model["properties"]:
            model["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        if "model" in model["properties"]:
            model["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schemas["GenerateRequest"].setdefault("required", []).append("sampling_params")
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    return raw


def test_openapi_covers_every_route(server):
    raw = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    operations = {f"{method.upper()} {path}" for path, item in raw["paths"].items() for method in item}
    assert operations == set(BUDGET)
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /generate", "POST /v1/responses"):
        method, path = label.split()
        operation = raw["paths"][path][method.lower()]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components")
        assert {"200", "400", "404", "413", "503"} <= set(operation["responses"])


def draw_cases(operation, examples: int) -> list:
    cases = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def draw(case):
        if isinstance(case.body, dict):
            case.body = integral_floats_as_ints(case.body)
        cases.append(case)

    draw()
    return cases


def test_generated_requests_conform(server):
    start = time.monotonic()
    raw = narrow(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
    schema = schemathesis.openapi.from_dict(raw)

    def call_and_validate(case) -> int:
        response = case.call(base_url=server.url, timeout=120)
        case.validate_response(response, checks=CHECKS)
        return response.status_code

    # Sent by many clients at once, as a server sees them: the scheduler batches them and the run stays short. Each
    # operation's cases go out while the next operation's are drawn: drawing (~10 s, half of it the chat route's
    # schema) is this process's work and answering the server's, so on two cores the two overlap.
    futures = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        for label, examples in BUDGET.items():
            operation = schema.find_operation_by_label(label)
            assert operation is not None, label
            futures += [(case, pool.submit(call_and_validate, case)) for case in draw_cases(operation, examples)]
        assert len(futures) >= MIN_CASES, len(futures)
        statuses: dict[int, int] = {}
        failures = []
        for case, future in futures:
            try:
                status = future.result()
                statuses[status] = statuses.get(status, 0) + 1
            except Exception as e:  # noqa: BLE001 - every failing case is reported, not just the first
                failures.append(f"{case.operation.label} body={str(case.body)[:300]}\n{e}")
    print(f"schemathesis: {len(futures)} cases drawn and sent in {time.monotonic() - start:.1f} s, statuses {statuses}")
    assert not failures, f"{len(failures)} failing cases; the first:\n" + "\n\n".join(failures[:3])
    assert statuses.get(200, 0) >= 250, statuses  # many requests generate, not only refusals
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
