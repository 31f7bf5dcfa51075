"""Structured outputs below the server: grammars compile (or fail with a readable message) on the real tokenizers,
a matcher allows exactly the continuations its grammar allows, and the sampler applies grammar masks and logit_bias
to the constrained rows only."""

import json
import random
import re

import jsonschema
import pytest
import torch

from radixserve.grammar import JSON_OBJECT_SCHEMA, GrammarCompiler, GrammarError
from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.sampling import SamplingParams
from radixserve.testing import smollm2_dir, tiny_model_dir

EOS = 2  # <|im_end|> of the SmolLM2 tokenizer, the EOS of every test model
VOCAB = 49152

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
    "required": ["name", "age", "role", "address"],
}


def _load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module", params=["tiny-qwen3", "smollm2"])
def tokenizer(request):
    return _load_tokenizer(tiny_model_dir("qwen3") if request.param == "tiny-qwen3" else smollm2_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def random_walk(compiler, spec, rng, max_tokens=400) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows, until it accepts EOS; checks EOS is refused before."""
    grammar = compiler.matcher(spec)
    tokens = []
    while not grammar.is_terminated:
        assert len(tokens) < max_tokens, "the grammar never ended"
        allowed = grammar.allowed_tokens()
        choices = allowed.nonzero().flatten().tolist()
        assert choices, "a live grammar must allow some token"
        token = rng.choice(choices)
        assert grammar.accept(token)
        tokens.append(token)
    assert tokens[-1] == EOS
    return tokens[:-1]


def test_random_walks_through_a_json_schema_always_validate(compiler, tokenizer):
    rng = random.Random(0)
    spec = ("json_schema", json.dumps(PERSON))
    for _ in range(8):
        text = tokenizer.decode(random_walk(compiler, spec, rng))
        jsonschema.validate(json.loads(text), PERSON)


def test_eos_is_allowed_only_where_the_grammar_accepts(compiler, tokenizer):
    grammar = compiler.matcher(
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    )
    for token in tokenizer.encode('{"a": 12', add_special_tokens=False):
        assert not grammar.allowed_tokens()[EOS]
        assert grammar.accept(token)
    assert not grammar.allowed_tokens()[EOS]  # 12 could go on: 123
    assert grammar.accept(tokenizer.encode("}", add_special_tokens=False)[0])
    allowed = grammar.allowed_tokens()
    assert allowed[EOS] and allowed.sum() == 1  # the object is closed: only EOS may follow


def test_json_strings_never_take_raw_control_characters(compiler):
    # Bounded strings (maxLength) too: xgrammar's own class for them lets U+0000-U+001F in; ours does not.
    for string_schema in ({"type": "string"}, {"type": "string", "maxLength": 5}, {"type": "string", "minLength": 1}):
        schema = json.dumps({"type": "object", "properties": {"s": string_schema}, "required": ["s"]})
        grammar = compiler.matcher(("json_schema", schema))
        assert grammar._matcher.accept_string('{"s": "')
        assert not grammar._matcher.accept_string("\x11"), string_schema
        assert grammar._matcher.accept_string("ok")


def test_a_rejected_token_stops_the_constraint_instead_of_raising(compiler, tokenizer):
    grammar = compiler.matcher(("regex", "[0-9]+"))
    assert not grammar.accept(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert grammar.broken and not grammar.active


def test_regex_and_ebnf_walks_fullmatch(compiler, tokenizer):
    rng = random.Random(1)
    pattern = r"(cat|dog)-[0-9]{2,4}( [a-z]{1,3})?"
    for _ in range(6):
        assert re.fullmatch(pattern, tokenizer.decode(random_walk(compiler, ("regex", pattern), rng)))
    ebnf = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    for _ in range(4):
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", tokenizer.decode(random_walk(compiler, ("ebnf", ebnf), rng)))


def test_json_object_mode_takes_any_object_and_nothing_else(compiler, tokenizer):
    # A uniform random walk through free-form JSON nests forever, so this one follows given texts instead.
    spec = ("json_schema", JSON_OBJECT_SCHEMA)
    grammar = compiler.matcher(spec)
    grammar.accept_all(tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False))
    assert grammar.active and grammar.allowed_tokens()[EOS]
    for text in ("[1]", '"x"', "42"):
        assert not compiler.matcher(spec).accept(tokenizer.encode(text, add_special_tokens=False)[0])


@pytest.mark.parametrize(
    "spec, words",
    [
        (("json_schema", "{not json"), ["invalid JSON schema", "not JSON"]),
        (("json_schema", '{"type": "frob"}'), ["invalid JSON schema", "frob"]),
        (("regex", "([a-z"), ["invalid regex", "Unclosed"]),
        (("ebnf", "root ::= missing_rule"), ["invalid EBNF grammar", "missing_rule"]),
        (("json_schema", '{"properties": ' * 70 + "{}" + "}" * 70), ["invalid JSON schema", "nested deeper than 64"]),
        (("json_schema", "[" * 5000 + "]" * 5000), ["invalid JSON schema", "nested deeper than 64"]),
        (("regex", "(" * 3000 + "a" + ")" * 3000), ["invalid regex", "maximum limit"]),
    ],
)
def test_bad_specs_raise_a_readable_grammar_error(compiler, spec, words):
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message and "\n" not in message  # no C++ source locations for the client


def test_check_refuses_a_grammar_that_admits_no_text(compiler):
    compiler.check(("regex", "a|b"))
    with pytest.raises(GrammarError, match="invalid regex: no text satisfies it"):
        compiler.check(("regex", r"[^\s\S]"))  # compiles, but no character matches


def test_compiled_grammars_are_cached_by_spec(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_entries=2)
    a, b, c = (("regex", r"a+"), ("regex", r"b+"), ("regex", r"c+"))
    assert compiler.compile(a) is compiler.compile(a)
    with pytest.raises(GrammarError):
        compiler.compile(("regex", "("))
    with pytest.raises(GrammarError):
        compiler.compile(("regex", "("))  # failures are cached too
    assert compiler.compilations == 2
    compiler.compile(b), compiler.compile(c)  # evicts the oldest entries beyond two
    compiler.compile(a)
    assert compiler.compilations == 5


def test_padded_model_vocab_ids_are_never_allowed(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB + 64, [EOS])
    grammar = compiler.matcher(("json_schema", JSON_OBJECT_SCHEMA))
    assert not grammar.allowed_tokens()[VOCAB:].any()


def test_replayed_outputs_reach_the_same_state(compiler, tokenizer):
    spec = ("json_schema", json.dumps(PERSON))
    prefix = tokenizer.encode('{"name": "Ann", "age": 3', add_special_tokens=False)
    stepped, replayed = compiler.matcher(spec), compiler.matcher(spec)
    for token in prefix:
        stepped.accept(token)
    replayed.accept_all(prefix)
    assert torch.equal(stepped.allowed_tokens(), replayed.allowed_tokens())


# ------------------------------------------------------------------------------------------- sampler


def sampling_state(compiler=None, spec=None, **params) -> SamplingRequestState:
    grammar = compiler.matcher(spec) if spec else None
    return SamplingRequestState(
        SamplingParams(**params), eos_ids=[EOS], num_outputs=0, output_counts=None, seen_mask=None, grammar=grammar
    )


def test_sampler_masks_constrained_rows_only(compiler, tokenizer):
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    spec = ("regex", "[0-9]+")
    states = [
        sampling_state(temperature=0.0),
        sampling_state(compiler, spec, temperature=0.0),
        sampling_state(temperature=0.0),
        sampling_state(compiler, spec, temperature=1.0),
    ]
    tokens, _ = sampler(logits.clone(), states, [0] * 4)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    for row in (1, 3):
        assert re.fullmatch("[0-9]+", tokenizer.decode([int(tokens[row])]))
    allowed = states[1].grammar.allowed_tokens()
    assert tokens[1] == torch.where(allowed, logits[1], float("-inf")).argmax()


def test_sampler_follows_the_grammar_to_the_end(compiler, tokenizer):
    sampler = Sampler(VOCAB, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    state = sampling_state(compiler, ("json_schema", json.dumps(PERSON)), temperature=1.0)
    tokens = []
    while not state.grammar.is_terminated:
        assert len(tokens) < 400
        token = int(sampler(torch.randn(1, VOCAB, generator=gen), [state], [len(tokens)])[0])
        state.on_sampled(token)
        tokens.append(token)
    assert tokens[-1] == EOS and state.num_outputs == len(tokens)
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), PERSON)


def test_grammar_wins_over_min_tokens_and_a_negative_bias(compiler, tokenizer):
    sampler = Sampler(VOCAB, torch.device("cpu"))
    done = tokenizer.encode("ab", add_special_tokens=False)
    for state in (
        sampling_state(compiler, ("regex", "ab"), temperature=0.0, min_new_tokens=50),
        sampling_state(compiler, ("regex", "ab"), temperature=1.0, logit_bias={EOS: -100.0}),
    ):
        state.grammar.accept_all(done)
        neighbour = sampling_state(temperature=0.0, min_new_tokens=50)
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
        tokens, _ = sampler(logits.clone(), [state, neighbour], [0, 0])
        # The grammar allows EOS alone: min_tokens and the bias cannot forbid it. The neighbour keeps its ban.
        assert tokens.tolist() == [EOS, logits[1].argmax()]


def test_logit_bias_moves_the_named_tokens_in_its_row():
    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.zeros(2, 8)
    logits[:, 0] = 5.0
    states = [sampling_state(temperature=0.0, logit_bias={3: 10.0, 0: -100.0}), sampling_state(temperature=0.0)]
    tokens, _ = sampler(logits.clone(), states, [0, 0])
    assert tokens.tolist() == [3, 0]
    banned = sampling_state(temperature=1.0, logit_bias={0: -100.0})
    draws, _ = sampler(logits[:1].repeat(2000, 1), [banned] * 2000, list(range(2000)))
    assert not (draws == 0).any()


def test_sampling_params_validate_the_new_fields():
    SamplingParams(json_schema="{}", logit_bias={5: 100.0}).validate(VOCAB)
    with pytest.raises(ValueError, match="at most one of json_schema, regex and ebnf"):
        SamplingParams(json_schema="{}", regex="a").validate()
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101.0}).validate()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={VOCAB: 1.0}).validate(VOCAB)
    assert SamplingParams(regex="a+").grammar_spec == ("regex", "a+")
    assert SamplingParams().grammar_spec is None
