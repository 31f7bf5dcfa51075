"""Reasoning models and stored responses below the server: the <think> splitter (streamed deltas add up to the whole
split, however the text is cut), where a reply starts read from real Qwen3 chat-template prompts, the grammar held
back until </think> (and replayed after a retraction), the response store's bounds and isolation, and the splice
that starts a follow-up's prompt with the previous turn's exact token ids."""

import asyncio
import random

import pytest

from radixserve.grammar import GrammarCompiler, WorkerGrammars
from radixserve.sampling import SamplingParams
from radixserve.testing import tiny_model_dir
from radixserve.tokenizer_loading import load_tokenizer
from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.reasoning import CLOSED, MAYBE, OPEN, ReasoningParser, ReasoningSplitter
from tokenizer_service.responses_prompt import turn_prompt
from tokenizer_service.responses_store import ResponseStore, StoredResponse, owner_of, pack_ids
from tokenizer_service.tokenization import Tokenization

QWEN3_DIR = tiny_model_dir("qwen3", tokenizer="qwen3")
THINK_END_ID = 151668


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QWEN3_DIR)


# ------------------------------------------------------------------------------------------ the splitter

SPLITS = [  # (start, text, reasoning, content)
    (MAYBE, "<think>\nfirst, think\n</think>\n\nThe answer.", "first, think", "The answer."),
    (MAYBE, "  <think>x</think>y", "x", "y"),
    (MAYBE, "<think>\ncut by max_tokens here", "cut by max_tokens here", ""),
    (MAYBE, "no thinking at all", "", "no thinking at all"),
    (MAYBE, "\n\nblank start kept", "", "\n\nblank start kept"),
    (MAYBE, '</think>\n\n{"a": 1}', "", '{"a": 1}'),
    (MAYBE, "words</think>stay content", "", "words</think>stay content"),
    (MAYBE, "<thi", "", "<thi"),
    (MAYBE, "<think>a </thi nk> b\n</think>c", "a </thi nk> b", "c"),
    (OPEN, "reasoning opened by the template\n</think>\n\nanswer", "reasoning opened by the template", "answer"),
    (OPEN, "<think>model wrote it again</think>answer", "model wrote it again", "answer"),
    (OPEN, "\ncut inside the reasoning \n", "cut inside the reasoning", ""),
    (CLOSED, "<think>\nnot reasoning\n</think>\n\nall content", "", "<think>\nnot reasoning\n</think>\n\nall content"),
]


@pytest.mark.parametrize("start,text,reasoning,content", SPLITS)
def test_split_whole_and_in_random_pieces(start, text, reasoning, content):
    whole = ReasoningSplitter(start)
    whole.feed(text)
    whole.finish()
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for seed in range(30):
        rng, splitter, pos, got = random.Random(seed), ReasoningSplitter(start), 0, ["", ""]
        while pos < len(text):
            step = rng.randint(1, 5)
            for i, piece in enumerate(splitter.feed(text[pos : pos + step])):
                got[i] += piece
            pos += step
        for i, piece in enumerate(splitter.finish()):
            got[i] += piece
        assert tuple(got) == (reasoning, content), seed


def test_where_a_reply_starts_is_read_from_the_rendered_prompt(tokenizer):
    qwen3 = ReasoningParser("qwen3", tokenizer, lambda t: tokenizer.decode([t]))
    r1 = ReasoningParser("deepseek-r1", tokenizer, lambda t: tokenizer.decode([t]))
    messages = [{"role": "user", "content": "hi"}]
    thinking = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    no_thinking = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False
    )
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert [qwen3.start_of_reply(ids) for ids in (thinking, no_thinking, opened)] == [MAYBE, CLOSED, OPEN]
    assert [r1.start_of_reply(ids) for ids in (thinking, no_thinking, opened)] == [OPEN, CLOSED, OPEN]
    assert qwen3.end_token_id == THINK_END_ID
    # A JSON schema waits for </think> unless the template closed the block; a regex holds the whole reply.
    for ids, starts_after in ((thinking, THINK_END_ID), (no_thinking, None)):
        fields = {"json_schema": "{}"}
        qwen3.reply(None, ids, fields)
        assert fields.get("grammar_starts_after") == starts_after
    fields = {"regex": "a+"}
    qwen3.reply(None, thinking, fields)
    assert "grammar_starts_after" not in fields


# ------------------------------------------------------------------------------------------ grammar start


def test_grammar_waits_for_the_end_of_the_reasoning_and_replays(tokenizer):
    compiler = GrammarCompiler(tokenizer, 151936, [151645])
    spec = ("json_schema", '{"enum": ["yes", "no"]}')
    grammar = compiler.matcher(spec, starts_after=THINK_END_ID)
    thinking = tokenizer.encode("some free thinking, not JSON", add_special_tokens=False)
    for token in thinking:
        assert not grammar.active and grammar.accept(token)  # unconstrained: the sampler applies no mask
    assert grammar.accept(THINK_END_ID) and grammar.active
    allowed = grammar.allowed_tokens().nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).startswith('"') for t in allowed)
    answer = tokenizer.encode('"no"', add_special_tokens=False)
    for token in answer:
        assert grammar.accept(token)
    assert grammar.allowed_tokens().nonzero().flatten().tolist() == [151645]
    # A retracted request's matcher is rebuilt by replaying its outputs: the same state.
    grammars = WorkerGrammars("xgrammar", QWEN3_DIR, 151936, [151645])
    params = SamplingParams(json_schema=spec[1], grammar_starts_after=THINK_END_ID)
    replayed = grammars.matcher(params, thinking + [THINK_END_ID] + answer)
    assert replayed.active and replayed.allowed_tokens().nonzero().flatten().tolist() == [151645]
    assert not grammars.matcher(params, thinking).active
    with pytest.raises(ValueError, match="grammar_starts_after"):
        SamplingParams(grammar_starts_after=151936).validate(151936)


# ------------------------------------------------------------------------------------------ the store


def entry(response_id, owner="", salt=None):
    return StoredResponse(response_id, owner, salt, {"id": response_id}, [], pack_ids([1, 2]), pack_ids([3]))


def test_store_bounds_count_per_key_and_age():
    now = [0.0]
    store = ResponseStore(max_per_owner=2, ttl_s=10, clock=lambda: now[0])
    alice, bob = owner_of("Bearer alice", "k"), owner_of("Bearer bob", "k")
    assert alice != bob and owner_of("Bearer alice", None) == ""  # without --api-key: one owner
    for i in range(3):
        store.put(entry(f"a{i}", alice))
        now[0] += 1
    store.put(entry("b0", bob))
    assert store.get(alice, None, "a0") is None  # the oldest of alice's went; bob's own bound is separate
    assert [store.get(alice, None, i) is not None for i in ("a1", "a2")] == [True, True]
    assert store.get(bob, None, "b0").token_ids() == ([1, 2], [3])
    assert store.get(bob, None, "a1") is None  # another key's response is not there
    now[0] = 11.5  # a1 was stored at 1, a2 at 2, b0 at 3
    assert store.get(alice, None, "a1") is None and store.get(alice, None, "a2") is not None
    now[0] = 13.0
    assert store.get(alice, None, "a2") is None and store.get(bob, None, "b0") is None and len(store) == 0
    assert ResponseStore(0, 10).put(entry("x")) is None and len(ResponseStore(0, 10)) == 0


def test_store_never_crosses_cache_salts():
    store = ResponseStore(8, 60)
    store.put(entry("r", salt="tenant-a"))
    assert store.get("", "tenant-a", "r") is not None
    assert store.get("", "tenant-b", "r") is None and store.get("", None, "r") is None
    assert not store.delete("", "tenant-b", "r") and store.get("", "tenant-a", "r") is not None
    assert store.delete("", "tenant-a", "r") and store.get("", "tenant-a", "r") is None


def test_store_shared_by_front_ends_through_one_file(tmp_path):
    # --api-server-count > 1: each front end opens the run directory's file; what one stores, the others find.
    now = [0.0]
    path = str(tmp_path / "responses.sqlite")
    first, second = (ResponseStore(2, 10, clock=lambda: now[0], path=path) for _ in range(2))
    first.put(entry("a0", "k"))
    now[0] += 1
    second.put(entry("a1", "k"))
    assert second.get("k", None, "a0").body == {"id": "a0"} and first.get("k", None, "a1") is not None
    now[0] += 1
    first.put(entry("a2", "k"))  # the bound per key counts both front ends' entries
    assert second.get("k", None, "a0") is None and len(second) == 2
    assert second.delete("k", None, "a1") and first.get("k", None, "a1") is None
    now[0] = 12.5  # a2 was stored at 2
    assert first.get("k", None, "a2") is None and len(first) == 0
    assert asyncio.run(first.run(first.get, "k", None, "a2")) is None  # off the event loop, as the routes call it
    first.close(), second.close()


# ------------------------------------------------------------------------------------------ the splice


def test_follow_up_prompt_starts_with_the_previous_turns_exact_ids(tokenizer):
    tokenization = Tokenization(tokenizer, 4096, 1)
    try:
        first = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Say hello."}]})
        prompt = asyncio.run(tokenization.encode_chat(first))
        # The model wrote "hello world" one letter at a time, not as the tokenizer would write it.
        output = (
            [tokenizer.convert_tokens_to_ids(c) for c in "hello"]
            + tokenizer.encode(" world", add_special_tokens=False)
            + [151645]
        )
        assert output[:5] != tokenizer.encode("hello", add_special_tokens=False)
        previous = StoredResponse("r", "", None, {}, [], pack_ids(prompt), pack_ids(output))
        follow_up = ChatCompletionRequest.model_validate(
            {
                "messages": [
                    {"role": "user", "content": "Say hello."},
                    {"role": "assistant", "content": "hello world"},
                    {"role": "user", "content": "Again."},
                ]
            }
        )
        plain = asyncio.run(tokenization.encode_chat(follow_up))
        spliced = asyncio.run(turn_prompt(tokenization, follow_up, previous))
        assert plain[: len(prompt + output)] != prompt + output  # re-encoding loses the cached output
        assert spliced[: len(prompt + output)] == prompt + output
        assert tokenizer.decode(spliced) == tokenizer.decode(plain)  # the same text
        # A template that rewrites the earlier turn: no splice, the plain prompt.
        rewritten = StoredResponse("r", "", None, {}, [], pack_ids(prompt), pack_ids(output[:-1] + [33]))
        assert asyncio.run(turn_prompt(tokenization, follow_up, rewritten)) == plain
    finally:
        tokenization.close()
