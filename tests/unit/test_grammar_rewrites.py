"""The bounded-string rewrite (radixserve/grammar_rewrites.py) keeps each JSON schema's language: at every step of
random walks, the unrolled grammar allows exactly the tokens xgrammar's own grammar allows."""

import json
import random

import pytest

from radixserve.grammar import GrammarCompiler
from radixserve.grammar_rewrites import MAX_UNROLLED_CHARACTERS, unroll_bounded_strings
from radixserve.testing import smollm2_dir

EOS = 2  # <|im_end|> of the SmolLM2 tokenizer
VOCAB = 49152

SCHEMAS = [
    {"type": "string", "maxLength": 6},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "minLength": 3, "maxLength": 3},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 7}},
                "required": ["city"],
            },
            "free": {"type": "string"},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "tags", "inner"],
    },
]


@pytest.fixture(scope="module")
def compilers():
    from radixserve.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir())
    return (
        GrammarCompiler(tokenizer, VOCAB, [EOS], unroll_bounded_strings=True),
        GrammarCompiler(tokenizer, VOCAB, [EOS], unroll_bounded_strings=False),
    )


def test_the_rewrite_touches_bounded_strings_only():
    ebnf = (
        'root ::= (("\\"" root_characters{2, 5} "\\"") | ("[" digits{0, 3} "]"))\n'
        'root_characters ::= (([^\\0-\\x1f\\"\\\\\\r\\n]))\ndigits ::= (([0-9]))'
    )
    out = unroll_bounded_strings(ebnf)
    assert 'root_characters root_characters root_characters__left3 "\\""' in out  # two required, then up to 3 more
    assert "digits{0, 3}" in out  # not a string's characters: left alone
    assert 'root_characters__left3 ::= ("" | (root_characters root_characters__left2)) (="\\"")' in out
    assert "root_characters__left4" not in out
    too_long = f'root ::= (("\\"" c{{0, {MAX_UNROLLED_CHARACTERS + 1}}} "\\""))\nc ::= (([a-z]))'
    assert unroll_bounded_strings(too_long) == too_long


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_unrolled_strings_allow_exactly_what_xgrammar_allows(compilers, schema):
    unrolled, plain = compilers
    spec = ("json_schema", json.dumps(schema))
    rng = random.Random(7)
    for _ in range(6):
        a, b = unrolled.matcher(spec), plain.matcher(spec)
        steps = 0
        while not a.is_terminated and steps < 250:  # an unbounded string may go on; the masks are what counts
            allowed = a.allowed_tokens()
            assert (allowed == b.allowed_tokens()).all(), f"masks differ after {steps} tokens"
            choices = allowed.nonzero().flatten().tolist()
            # Mostly short tokens, so that walks reach the bounds rather than stopping at the first quote.
            token = rng.choice([t for t in choices[:4000]] or choices)
            assert a.accept(token) and b.accept(token)
            steps += 1
        assert a.is_terminated == b.is_terminated
