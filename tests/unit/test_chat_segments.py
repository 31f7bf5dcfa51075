"""Chat prompts tokenized per piece with cached ids (tokenizer_service/chat_segments.py) give exactly the ids of the
whole prompt, as `apply_chat_template(tokenize=True)` gives them, for the demo model's tokenizer (SmolLM2) and
Qwen3's: fuzzed conversations through the server's own path (Tokenization.encode_chat), with pieces cached across
examples and salts. Also the cut at added tokens (leftmost-longest, overlapping tokens), the start-up check's
fallback, the cache's bound and its namespaces."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from radixserve.testing import smollm2_dir
from radixserve.testing.qwen3_tokenizer import qwen3_tokenizer_dir
from radixserve.tokenizer_loading import load_tokenizer
from tokenizer_service.chat_segments import SegmentEncoder
from tokenizer_service.errors import RequestError
from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.segment_cache import SegmentCache
from tokenizer_service.structured_outputs import chat_template_inputs
from tokenizer_service.tokenization import Tokenization

# Where pieces meet: special tokens' text, their halves, whitespace, NFC-sensitive and multi-byte text, digits.
FRAGMENTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|",
    "|>",
    "<|im_start",
    "im_end|>",
    "system",
    "user\n",
    "assistant",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    " \n ",
    "e\u0301",
    "\u00e9",
    "\u0301",
    "\u00c5",
    "A\u030a",
    "你好",
    "🫠",
    "👩\u200d💻",
    "123",
    "4567",
    "'s",
    "'ll",
    '{"a": 1}',
]
TEXT = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(exclude_categories=("Cs",)), max_size=10)), max_size=8
).map("".join)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@st.composite
def chat_bodies(draw) -> dict:
    messages = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 5))):
        role = draw(st.sampled_from(["user", "user", "assistant", "tool"]))
        message: dict = {"role": role, "content": draw(TEXT)}
        if role == "assistant" and draw(st.booleans()):
            arguments = json.dumps({"city": draw(TEXT)}, ensure_ascii=draw(st.booleans()))
            message["tool_calls"] = [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ]
            if draw(st.booleans()):
                message["content"] = None
        if role == "tool":
            message["tool_call_id"] = "call_1"
        messages.append(message)
    body: dict = {"messages": messages, "add_generation_prompt": draw(st.booleans())}
    if draw(st.booleans()):
        body["tools"] = [WEATHER]
    thinking = draw(st.sampled_from([None, True, False]))
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if not body["add_generation_prompt"] and messages[-1]["role"] == "assistant" and draw(st.booleans()):
        body["continue_final_message"] = True
    body["cache_salt"] = draw(st.sampled_from([None, "tenant-a", "tenant-b"]))
    return body


def whole_prompt_ids(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """What the server computed before pieces: the template applied and tokenized in one call."""
    messages, tool_options = chat_template_inputs(req.template_messages(), req.tools, tokenizer)
    options = {**dict(req.chat_template_kwargs or {}), **tool_options}
    if req.continue_final_message:
        options["continue_final_message"] = True
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False, **options
        )
    )


TOKENIZER_DIRS = {"smollm2": smollm2_dir, "qwen3": qwen3_tokenizer_dir}


@pytest.fixture(scope="module", params=sorted(TOKENIZER_DIRS))
def tokenizations(request):
    """(reference tokenizer, per-piece Tokenizations, whole-prompt Tokenization) of one tokenizer: per piece in the
    pool only, and on the event loop where little is new (the server's default); the per-piece caches live across
    the fuzzed examples, so most of them meet pieces cached by earlier ones."""
    tokenizer = load_tokenizer(TOKENIZER_DIRS[request.param]())
    pool = Tokenization(tokenizer, 4096, 2, segment_cache_mib=64)
    inline = Tokenization(tokenizer, 4096, 2, segment_cache_mib=64, inline_chars=64)
    whole = Tokenization(tokenizer, 4096, 2, segment_cache_mib=0)
    assert pool.segments is not None and inline.segments is not None, pool.whole_prompt_reason
    yield tokenizer, (pool, inline), whole
    for tokenization in (pool, inline, whole):
        tokenization.close()


def encode(tokenization: Tokenization, req: ChatCompletionRequest) -> list[int] | str:
    try:
        return asyncio.run(tokenization.encode_chat(req))
    except RequestError as e:
        return f"RequestError: {e.message}"


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=chat_bodies())
def test_piece_ids_equal_whole_prompt_ids_on_fuzzed_chats(tokenizations, body):
    tokenizer, pieces, whole = tokenizations
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        assume(False)
    try:
        expected: list[int] | str = whole_prompt_ids(tokenizer, req)
    except Exception:  # noqa: BLE001 - the template refuses this chat: the server must answer a 400 for it too
        expected = "refused"
    for tokenization in pieces:
        for attempt in range(2):  # the second time every piece comes from the cache
            got = encode(tokenization, req)
            if expected == "refused":
                assert isinstance(got, str) and got.startswith("RequestError"), got
            else:
                assert got == expected, f"attempt {attempt}: {body!r}"
    got_whole = encode(whole, req)
    assert got_whole == expected or (expected == "refused" and got_whole.startswith("RequestError"))


# ----------------------------------------------------------------------------------- the cut at added tokens


@pytest.fixture(scope="module")
def overlapping_backend():
    """The SmolLM2 tokenizer with added tokens that overlap its own and each other (a prefix of <|im_start|>, a
    longer token that starts with it, one inside another), normalized and not."""
    from tokenizers import AddedToken

    backend = load_tokenizer(smollm2_dir())._tokenizer
    backend.add_tokens(
        [
            AddedToken("<|im", normalized=False),
            AddedToken("<|im_start|>user", normalized=False),
            AddedToken("start|>", normalized=False),
            AddedToken("tart", normalized=True),
            AddedToken("ab", normalized=False),
            AddedToken("abc", normalized=False),
        ]
    )
    return backend


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(
        st.sampled_from(
            [
                "<|im_start|>",
                "<|im_end|>",
                "user",
                "<|im",
                "start|>",
                "tart",
                "ab",
                "c",
                "abc",
                " ",
                "\n",
                "x",
                "<",
                "|",
            ]
        ),
        max_size=24,
    ).map("".join)
)
def test_cut_is_the_tokenizers_leftmost_longest_match(overlapping_backend, text):
    encoder = SegmentEncoder(overlapping_backend, SegmentCache(1 << 20, ()))
    expected = overlapping_backend.encode_batch([text], add_special_tokens=False)[0].ids
    assert encoder.encode(text, None) == expected
    assert encoder.encode(text, None) == expected  # from the cache


# -------------------------------------------------------------------------------------- start-up fallback


def _tokenizer_variant(tmp_path, edit) -> object:
    """The SmolLM2 tokenizer directory with its tokenizer.json changed by `edit`."""
    source = smollm2_dir()
    spec = json.loads((source / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    return load_tokenizer(tmp_path)


def test_start_up_check_falls_back_where_pieces_would_differ(tmp_path, caplog):
    # Metaspace that marks only the start of the whole text with a space (Ġ, in this vocabulary): a piece encoded
    # alone would get the mark too.
    def metaspace_first(spec):
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u0120", "prepend_scheme": "first", "split": True}

    tokenizer = _tokenizer_variant(tmp_path, metaspace_first)
    with caplog.at_level(logging.WARNING, logger="tokenizer_service.tokenization"):
        tokenization = Tokenization(tokenizer, 4096, 1, segment_cache_mib=64)
    try:
        assert tokenization.segments is None
        assert "piece-wise ids differ" in tokenization.whole_prompt_reason
        assert "tokenized whole" in caplog.text and tokenization.whole_prompt_reason in caplog.text
        req = ChatCompletionRequest(
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
        )
        assert encode(tokenization, req) == whole_prompt_ids(tokenizer, req)
    finally:
        tokenization.close()


def test_added_tokens_that_strip_whitespace_mean_whole_prompts(tmp_path):
    def lstrip_im_end(spec):
        for token in spec["added_tokens"]:
            if token["content"] == "<|im_end|>":
                token["lstrip"] = True

    tokenizer = _tokenizer_variant(tmp_path, lstrip_im_end)
    tokenization = Tokenization(tokenizer, 4096, 1, segment_cache_mib=64)
    try:
        assert tokenization.segments is None and "<|im_end|>" in tokenization.whole_prompt_reason
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello there   "}])
        assert encode(tokenization, req) == whole_prompt_ids(tokenizer, req)
    finally:
        tokenization.close()


# ------------------------------------------------------------------------------------------------ the cache


def cached(cache: SegmentCache, text: str):
    """The cached ids of `text` or None, leaving no claim behind."""
    got = cache.claim(None, text)
    if got is None:
        cache.abandon(None, [text], LookupError(text))
    return got


def test_cache_keeps_recent_pieces_within_its_budget():
    ints = tuple(range(1000))
    one = SegmentCache._cost("a" * 100, tuple(range(50)))
    cache = SegmentCache(3 * one, ints)
    for name in "abcd":
        cache.put(None, name * 100, list(range(50)))
        if name == "c":
            assert cached(cache, "a" * 100) is not None  # a is now the most recent: b goes first
    assert cache.bytes <= cache.budget_bytes and len(cache) == 3 and cache.evictions == 1
    assert cached(cache, "b" * 100) is None
    assert [cached(cache, n * 100) is not None for n in "acd"] == [True, True, True]
    assert cache.put(None, "e" * 10_000, list(range(900))) == tuple(range(900))  # larger than the budget: not kept
    assert cached(cache, "e" * 10_000) is None and len(cache) == 3
    shared = cache.put(None, "f", [900, 901])  # ids shared from the table (not fresh ints): 8 bytes a token
    assert shared == (900, 901) and shared[1] is ints[901]


class GatedBackend:
    """The real Rust tokenizer, whose encode_batch records what it encodes and waits for a gate."""

    def __init__(self, real):
        self.real, self.encoded, self.gate = real, [], threading.Event()

    def encode_batch(self, texts, add_special_tokens):
        self.encoded.extend(texts)
        assert self.gate.wait(30)
        return self.real.encode_batch(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_piece_that_many_requests_bring_at_once_is_encoded_once():
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    backend = GatedBackend(tokenizer._tokenizer)
    encoder = SegmentEncoder(backend, SegmentCache(1 << 24, ()))
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Rules. " * 200}, {"role": "user", "content": "Hi"}], tokenize=False
    )
    pieces = len({part for part in encoder.split(text) if isinstance(part, str)})
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(encoder.encode(text, None))) for _ in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(encoder.cache._pending) < pieces and time.monotonic() < deadline:  # every piece claimed by someone
        time.sleep(0.01)
    time.sleep(0.2)  # the other threads reach their waits
    backend.gate.set()
    for thread in threads:
        thread.join(30)
    expected = tokenizer._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    assert results == [expected] * 8
    assert sorted(backend.encoded) == sorted(set(backend.encoded)) and len(backend.encoded) == pieces == 3
    assert encoder.cache.misses == pieces and encoder.cache.hits == 7 * pieces


def test_waiters_get_the_error_of_a_piece_that_could_not_be_encoded():
    cache = SegmentCache(1 << 20, ())
    assert cache.claim("salt", "piece") is None
    waiter = cache.claim("salt", "piece")
    cache.abandon("salt", ["piece"], ValueError("bad text"))
    with pytest.raises(ValueError, match="bad text"):
        waiter.result(timeout=1)
    assert cache.claim("salt", "piece") is None  # free to be tried again


def test_salts_never_share_pieces():
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    tokenization = Tokenization(tokenizer, 4096, 1, segment_cache_mib=64)
    cache = tokenization.segments.cache
    body = {
        "messages": [
            {"role": "system", "content": "A long and secret system prompt. " * 20},
            {"role": "user", "content": "Hi"},
        ]
    }
    try:
        for salt, seen in (("tenant-a", False), ("tenant-a", True), ("tenant-b", False), (None, False)):
            hits, misses = cache.hits, cache.misses
            ids = encode(tokenization, ChatCompletionRequest(**body, cache_salt=salt))
            assert ids == whole_prompt_ids(tokenizer, ChatCompletionRequest(**body))
            if seen:  # the second time in tenant-a's namespace: every piece cached
                assert cache.misses == misses and cache.hits > hits
            else:  # a namespace's first request: it finds nothing another tenant's requests left
                assert cache.hits == hits and cache.misses > misses
    finally:
        tokenization.close()


class CountingPool:
    """The tokenizer pool, counting what is handed to it."""

    def __init__(self, pool):
        self.pool, self.submitted = pool, 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return self.pool.submit(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.pool, name)


def test_a_known_system_prompt_with_a_short_question_is_tokenized_on_the_loop():
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    tokenization = Tokenization(tokenizer, 8192, 2, segment_cache_mib=64, inline_chars=256)
    tokenization._pool = pool = CountingPool(tokenization._pool)
    system = {"role": "system", "content": "You are the support assistant of a shop. Answer in full sentences. " * 60}

    def chat(question: str) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[system, {"role": "user", "content": question}])

    try:
        first = chat("Where is my order?")
        assert encode(tokenization, first) == whole_prompt_ids(tokenizer, first)
        assert pool.submitted == 1  # a new system prompt: more new text than the loop takes, so the pool
        for question in ("And my refund?", "Can I change the address?", "Thanks!"):
            req = chat(question)
            assert encode(tokenization, req) == whole_prompt_ids(tokenizer, req)
        assert pool.submitted == 1  # known prompt + a short question each: on the loop
        long_question = chat("Please read this carefully. " * 20)  # 540 new characters > 256
        assert encode(tokenization, long_question) == whole_prompt_ids(tokenizer, long_question)
        assert pool.submitted == 2
    finally:
        tokenization.close()
    off = Tokenization(tokenizer, 8192, 2, segment_cache_mib=64, inline_chars=0)
    off._pool = pool = CountingPool(off._pool)
    try:
        for question in ("Where is my order?", "And my refund?"):
            assert encode(off, chat(question)) == whole_prompt_ids(tokenizer, chat(question))
        assert pool.submitted == 2  # --inline-tokenize-chars 0: always the pool
    finally:
        off.close()


def test_the_loop_neither_claims_too_much_new_text_nor_waits_for_a_piece_being_encoded():
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    encoder = SegmentEncoder(tokenizer._tokenizer, SegmentCache(1 << 24, ()))
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Rules. " * 200}, {"role": "user", "content": "Hi"}], tokenize=False
    )
    expected = tokenizer._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    assert encoder.encode_known(text, None, 100) is None  # 1,400 new characters: for the pool
    assert not encoder.cache._pending and len(encoder.cache) == 0  # and nothing claimed or kept on the way
    system_piece = max((p for p in encoder.split(text) if isinstance(p, str)), key=len)
    assert encoder.cache.claim(None, system_piece) is None  # another request is encoding the long piece now
    assert encoder.encode_known(text, None, 4096) == expected  # encoded here too, without waiting for it
    assert (None, system_piece) in encoder.cache._pending  # still the other request's to put
    assert encoder.encode_known(text, None, 0) is None  # the long piece is not cached yet
    encoder.cache.put(None, system_piece, tokenizer._tokenizer.encode(system_piece, add_special_tokens=False).ids)
    assert encoder.encode_known(text, None, 0) == expected  # every piece cached: nothing new at all
