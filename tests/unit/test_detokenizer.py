"""IncrementalDetokenizer against a real byte-level BPE tokenizer: SmolLM2's (GPT-2 style, ChatML special
tokens), built by radixserve.testing like every other model directory of the suite."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.detokenizer import IncrementalDetokenizer
from scheduler_service.stop_strings import StopStringMatcher

FFFD = "\ufffd"

# Characters that byte-level BPE splits over several tokens (3- and 4-byte UTF-8, ZWJ sequences).
HARD_TEXT = ["𠀀𠀁𠀂", "🫠🫡🧑\u200d🧑\u200d🧒", "龘靐齉", "ꙮ", "世界", "😀🎉", "naïve", "e\u0301", "\n\n", " "]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def decode(tok, ids, skip_special_tokens=True):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok, ids, chunk_sizes=(1,), flush=True):
    """Feed ids in chunks (sizes cycling through chunk_sizes); returns (deltas, last delta object). The scheduler's
    own stop-string matcher decides where the sequence ends, as in the server: the chunk ends at the token that
    completes a stop string and the detokenizer is told which one."""
    matcher = StopStringMatcher(detok.tokenizer, detok.stop_strings, detok.skip_special_tokens)
    deltas, last, pos, k = [], None, 0, 0
    while pos < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        chunk, stop = ids[pos : pos + size], None
        for end in range(pos + 1, pos + len(chunk) + 1):
            stop = matcher.find(list(ids[:end]), final=end == len(ids))  # the last token, as at max_tokens
            if stop is not None:
                chunk = ids[pos:end]
                break
        last = detok.add_tokens(chunk) if stop is None else detok.finish(stop, chunk)
        deltas.append(last.text)
        pos, k = pos + size, k + 1
        if stop is not None:
            return deltas, last
    if flush:
        last = detok.flush()
        deltas.append(last.text)
    return deltas, last


def byte_token_ids(tok) -> dict[int, int]:
    """Token id of each single byte the vocabulary holds, through the GPT-2 byte-to-unicode alphabet of byte-level
    BPE: printable Latin-1 bytes stand for themselves, the other 68 are mapped to U+0100 onwards in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbol = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbol:
            symbol[b] = chr(256 + extra)
            extra += 1
    ids = {b: tok.convert_tokens_to_ids(symbol[b]) for b in range(256)}
    # SmolLM2's vocabulary lacks 21 byte tokens (a few control bytes and bytes that never occur in UTF-8 text or
    # only in code points above U+3FFFF); every byte a 1-3 byte character or a U+1xxxx-U+3xxxx emoji/CJK needs
    # is there, continuation bytes included.
    present = {b: i for b, i in ids.items() if tok.convert_ids_to_tokens(i) == symbol[b]}
    assert len(present) == 235 and len(set(present.values())) == 235
    assert all(b in present for b in [*range(0x80, 0xC0), *range(0xC2, 0xF1)])
    return present


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Stop-string semantics by definition: read `text` one character at a time and stop at the first
    character that completes a stop string (the earliest-starting one if several end there)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)  # same end, longest = earliest start
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


# ------------------------------------------------------------------------------- UTF-8 handling


@pytest.mark.parametrize("text", [*HARD_TEXT, "Hello 世界 😀🎉 𠀀 done", "The answer is 42.\n"])
@pytest.mark.parametrize("chunk_sizes", [(1,), (2, 3), (1, 4, 1)])
def test_deltas_concatenate_to_full_decode(tok, text, chunk_sizes):
    ids = tok.encode(text)
    deltas, _ = stream(IncrementalDetokenizer(tok, tok.encode("Prompt:")), ids, chunk_sizes)
    assert "".join(deltas) == decode(tok, ids)
    assert not any(FFFD in d for d in deltas)


def test_character_split_over_four_tokens_is_held_until_complete(tok):
    ids = tok.encode("𠀀")
    assert len(ids) == 4  # the premise: one character, four byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add_tokens([i]).text for i in ids] == ["", "", "", "𠀀"]
    assert detok.flush().text == ""


def test_flush_releases_incomplete_character_as_full_decode_shows_it(tok):
    ids = tok.encode("ok 𠀀")[:-1]  # cut inside the last character
    deltas, _ = stream(IncrementalDetokenizer(tok), ids)
    assert FFFD not in "".join(deltas[:-1])  # only the final flush may show it
    assert "".join(deltas) == decode(tok, ids)
    assert deltas[-1].endswith(FFFD)


def test_prompt_ending_inside_a_character(tok):
    char_ids = tok.encode("𠀀")
    output = char_ids[2:] + tok.encode(" ok")
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids=char_ids[:2]), output)
    assert "".join(deltas) == decode(tok, output)


def test_prompt_context_is_not_part_of_output(tok):
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode("Hello there")
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), output)
    assert "".join(deltas) == "Hello there"


def leading_space_stripping_tokenizer():
    """SentencePiece-like: "▁" marks a space, and the Metaspace decoder drops the space at the very start, so a
    token decodes differently at the start of a string than after another token."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {piece: i for i, piece in enumerate(["▁Hello", "▁world", "!", "▁again", "<unk>"])}
    toy = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    toy.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return toy


def test_prompt_context_keeps_leading_space_of_first_output_token():
    toy = leading_space_stripping_tokenizer()
    deltas, _ = stream(IncrementalDetokenizer(toy, prompt_ids=[0]), [1, 2, 3])
    assert "".join(deltas) == " world! again"  # as in decode(prompt + output), minus the prompt
    deltas, _ = stream(IncrementalDetokenizer(toy), [1, 2, 3])
    assert "".join(deltas) == toy.decode([1, 2, 3]) == "world! again"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)[0]) == "Hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "Hi<|im_end|>"


def test_numpy_token_ids(tok):
    ids = np.asarray(tok.encode("Hello 世界"), dtype=np.int32)
    detok = IncrementalDetokenizer(tok, prompt_ids=np.asarray(tok.encode("Q:"), dtype=np.int32))
    text = detok.add_tokens(ids).text + detok.flush().text
    assert text == "Hello 世界"
    assert detok.output_text == text


def test_window_stays_small_on_long_output(tok):
    text = "Streaming text with 世界, emoji 😀🧑\u200d🧒 and 𠀀𠀁 rare CJK. " * 60
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt"))
    deltas, largest = [], 0
    for i in ids:
        deltas.append(detok.add_tokens([i]).text)
        largest = max(largest, detok.window_size)
    assert len(ids) > 1000
    assert largest <= 12
    assert "".join(deltas) + detok.flush().text == decode(tok, ids)


def test_window_stays_small_on_invalid_bytes(tok):
    # A model can emit byte tokens that never form characters (every prefix decodes to ...U+FFFD).
    bytes_to_id = byte_token_ids(tok)
    garbage = bytes([0x80, 0xBF, 0xE4, 0xF4, 0xF0, 0x9F, 0x98] * 80)
    ids = [bytes_to_id[b] for b in garbage]
    detok = IncrementalDetokenizer(tok)
    deltas, largest = [], 0
    for i in ids:
        deltas.append(detok.add_tokens([i]).text)
        largest = max(largest, detok.window_size)
    deltas.append(detok.flush().text)
    assert "".join(deltas) == decode(tok, ids) == garbage.decode("utf-8", "replace")
    assert largest <= 12


# Hypothesis: random text with plenty of multi-byte characters, random chunking, random context.
_text = st.lists(st.one_of(st.characters(blacklist_categories=("Cs",)), st.sampled_from(HARD_TEXT)), max_size=25).map(
    "".join
)
_chunks = st.lists(st.integers(1, 4), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text, chunk_sizes=_chunks, with_prompt=st.booleans())
def test_property_stream_equals_full_decode(tok, text, chunk_sizes, with_prompt):
    ids = tok.encode(text)
    prompt = tok.encode("System: be brief.\nUser:") if with_prompt else []
    deltas, last = stream(IncrementalDetokenizer(tok, prompt), ids, tuple(chunk_sizes))
    full = decode(tok, ids)
    assert "".join(deltas) == full
    assert not last.stopped
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=40), chunk_sizes=_chunks)
def test_property_random_bytes_equal_full_decode(tok, data, chunk_sizes):
    bytes_to_id = byte_token_ids(tok)
    data = bytes(b for b in data if b in bytes_to_id)  # the few bytes without a token cannot be generated
    ids = [bytes_to_id[b] for b in data]
    deltas, _ = stream(IncrementalDetokenizer(tok), ids, tuple(chunk_sizes))
    assert "".join(deltas) == decode(tok, ids) == data.decode("utf-8", "replace")


# ---------------------------------------------------------------------------------- stop strings


def run_stop(tok, text, stops, include=False, chunk_sizes=(1,)):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop_strings=stops, include_stop_str_in_output=include)
    deltas, last = stream(detok, ids, chunk_sizes)
    return deltas, last, detok


def test_multi_token_stop_string(tok):
    text = "The answer is 42.\n\nUser: next question"
    stop = "\n\nUser:"
    assert len(tok.encode(stop)) > 1
    deltas, last, _ = run_stop(tok, text, [stop])
    assert "".join(deltas) == "The answer is 42."
    assert last.stopped and last.matched_stop == stop


def test_stop_string_starting_and_ending_mid_token(tok):
    text = "The answer is 42."
    assert " answer" in [tok.decode([i]) for i in tok.encode(text)]  # "swe" is inside one token
    deltas, last, _ = run_stop(tok, text, ["swe"])
    assert "".join(deltas) == "The an"
    assert last.matched_stop == "swe"
    deltas, last, _ = run_stop(tok, text, ["swe"], include=True)
    assert "".join(deltas) == "The answe"  # the rest of the token after the stop string is dropped


def test_include_stop_str_in_output_multi_token(tok):
    deltas, last, _ = run_stop(tok, "Hello 世界 😀 more", ["界 😀"], include=True)
    assert "".join(deltas) == "Hello 世界 😀"
    assert last.stopped


def test_partial_stop_string_is_held_back_then_released(tok):
    ids = tok.encode("Hello User x Usx")
    assert [tok.decode([i]) for i in ids] == ["Hello", " User", " x", " Us", "x"]
    detok = IncrementalDetokenizer(tok, stop_strings=["User:"])
    shown = [detok.add_tokens([i]).text for i in ids]
    # " User" might be the start of "User:": held until " x" proves it is not; same for " Us".
    assert shown == ["Hello", " ", "User x", " ", "Usx"]
    assert not detok.stopped and detok.flush().text == ""


def test_partial_stop_string_released_by_flush(tok):
    deltas, last, detok = run_stop(tok, "Hello Use", ["User:"])
    assert "".join(deltas[:-1]) == "Hello "
    assert deltas[-1] == "Use"  # the flush at the end of generation
    assert not last.stopped and detok.output_text == "Hello Use"


def test_stop_at_start_and_special_token_text(tok):
    deltas, last, _ = run_stop(tok, "STOP here", ["STOP"])
    assert "".join(deltas) == "" and last.stopped
    ids = tok.encode("Answer<|im_end|>trailing")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, stop_strings=["<|im_end|>"])
    deltas, last = stream(detok, ids)
    assert "".join(deltas) == "Answer" and last.matched_stop == "<|im_end|>"


def test_first_completed_stop_wins_and_later_tokens_are_ignored(tok):
    deltas, last, detok = run_stop(tok, "abcdef ghij", ["cdef", "bc", "xyz"])
    assert "".join(deltas) == "a" and last.matched_stop == "bc"
    after = detok.add_tokens(tok.encode(" more"))
    assert after.text == "" and after.stopped
    assert detok.flush().text == ""


def test_stop_completed_first_wins_over_one_starting_earlier(tok):
    # Both stop strings lie inside one step's text; reading character by character, "bc" completes
    # before "abcd" does, so generation stops there.
    deltas, last, _ = run_stop(tok, "xabcdy", ["abcd", "bc"], chunk_sizes=(10,))
    assert "".join(deltas) == "xa" and last.matched_stop == "bc"
    deltas, last, _ = run_stop(tok, "xabcdy", ["abcd", "abc"], include=True, chunk_sizes=(10,))
    assert "".join(deltas) == "xabc" and last.matched_stop == "abc"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=_text,
    data=st.data(),
    include=st.booleans(),
    chunk_sizes=_chunks,
)
def test_property_stop_strings_match_reference(tok, text, data, include, chunk_sizes):
    ids = tok.encode(text)
    full = decode(tok, ids)
    # Stop strings: substrings of the output (so they do occur, often mid-token) and random strings.
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start : start + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(_text.filter(bool)))
    expected, expected_stop = reference_stop(full, stops, include)

    detok = IncrementalDetokenizer(tok, stop_strings=stops, include_stop_str_in_output=include)
    deltas, last = stream(detok, ids, tuple(chunk_sizes))
    assert "".join(deltas) == expected
    assert last.stopped == (expected_stop is not None)
    assert last.matched_stop == expected_stop
    # A client never sees a stop string it should not see, at any point of the stream.
    shown = ""
    for delta in deltas:
        shown += delta
        assert expected.startswith(shown)
