"""Engine.generate and the HTTP server return the same text for the same request: both run every scheduler output
through radixserve/request_pipeline.py. Greedy decoding of the tiny random Llama is deterministic, so the cases
(stop strings, stop tokens, with and without include_stop_str_in_output, a stop string ignored under
min_new_tokens) are derived from a first greedy run, and each is compared field by field: the Engine's result,
/generate, and the streamed /v1/completions text."""

from __future__ import annotations

import json

import httpx
import pytest

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL_DIR = tiny_model_dir("llama")
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MAX_NEW = 20
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(str(MODEL_DIR), device="cpu", max_total_tokens=2048) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server  # shared with other modules (tests/conftest.py)


def token_texts(engine, token_ids: list[int]) -> list[str]:
    return [engine.tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in token_ids]


def mid_token_stop(engine, token_ids: list[int]) -> tuple[str, int]:
    """A 3-character stop string that starts inside a token after the first few and first occurs there, and the
    number of tokens up to the one that completes it."""
    pieces = token_texts(engine, token_ids)
    text = "".join(pieces)
    start = 0
    for i, piece in enumerate(pieces):
        for inner in range(1, len(piece)):
            stop = text[start + inner : start + inner + 3]
            if i >= 2 and len(stop) == 3 and stop.isprintable() and text.find(stop) == start + inner:
                return stop, i
        start += len(piece)
    pytest.fail(f"no mid-token stop string candidate in {pieces}")


def cases(engine) -> dict[str, dict]:
    reference = engine.generate(PROMPT, SamplingParams(**GREEDY))
    ids = reference.token_ids
    stop, _ = mid_token_stop(engine, ids)
    stop_token = ids[6]
    # A string completed early (by token 2) and maybe again later: below min_new_tokens the scheduler does not stop
    # at it, so the front ends must show it as ordinary text.
    early = "".join(token_texts(engine, ids[:3]))[-2:]
    return {
        "length": GREEDY,
        "stop string": {**GREEDY, "stop": [stop, "never-appears-zzz"]},
        "stop string kept": {**GREEDY, "stop": [stop], "include_stop_str_in_output": True},
        "stop token": {**GREEDY, "stop_token_ids": [stop_token]},
        "stop token kept": {**GREEDY, "stop_token_ids": [stop_token], "include_stop_str_in_output": True},
        "stop string under min_new_tokens": {**GREEDY, "stop": [early], "min_new_tokens": 6},
    }


def streamed_completion_text(server, params: dict) -> tuple[str, str]:
    """The OpenAI completions stream, concatenated, and its finish_reason."""
    body = {
        "prompt": PROMPT,
        "max_tokens": params["max_new_tokens"],
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stop": params.get("stop"),
        "stop_token_ids": params.get("stop_token_ids"),
        "include_stop_str_in_output": params.get("include_stop_str_in_output", False),
        "min_tokens": params.get("min_new_tokens", 0),
    }
    text, finish_reason = "", None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: ") :])["choices"][0]
                text += choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
    return text, finish_reason


def test_engine_and_http_give_the_same_text(engine, server):
    all_cases = cases(engine)
    results = dict(
        zip(all_cases, engine.generate([PROMPT] * len(all_cases), [SamplingParams(**p) for p in all_cases.values()]))
    )
    for name, params in all_cases.items():
        mine = results[name]
        http = httpx.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": params}, timeout=60).json()
        assert http["output_ids"] == mine.token_ids, name
        assert http["text"] == mine.text, name
        finish = http["meta_info"]["finish_reason"]
        assert finish["type"] == mine.finish_reason, name
        assert finish.get("matched") == (mine.matched_stop if mine.finish_reason == "stop" else None), name
        assert streamed_completion_text(server, params) == (mine.text, mine.finish_reason), name

    # What each case must show, so that "the same" is also right.
    full = results["length"]
    assert full.finish_reason == "length" and len(full.token_ids) == MAX_NEW
    assert full.text == engine.tokenizer.decode(full.token_ids, clean_up_tokenization_spaces=False)
    stop = all_cases["stop string"]["stop"][0]
    cut = full.text.find(stop)
    stopped, kept = results["stop string"], results["stop string kept"]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop and stopped.text == full.text[:cut]
    assert kept.text == full.text[: cut + len(stop)] and kept.token_ids == stopped.token_ids
    stop_token = all_cases["stop token"]["stop_token_ids"][0]
    first = full.token_ids.index(stop_token)
    by_token, by_token_kept = results["stop token"], results["stop token kept"]
    assert by_token.token_ids == full.token_ids[: first + 1] and by_token.matched_stop == stop_token
    # The stop token counts as a completion token, but its text is hidden unless asked for.
    hidden = engine.tokenizer.decode(full.token_ids[:first], clean_up_tokenization_spaces=False)
    assert by_token.text == hidden
    assert by_token_kept.text == engine.tokenizer.decode(
        full.token_ids[: first + 1], clean_up_tokenization_spaces=False
    )
    late = results["stop string under min_new_tokens"]
    early = all_cases["stop string under min_new_tokens"]["stop"][0]
    assert len(late.token_ids) >= 6 and late.text.startswith(full.text[: full.text.find(early) + len(early)])
    assert engine.server_info()["kv_invariant_ok"]
    assert httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_invariant_ok"]
