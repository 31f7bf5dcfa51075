"""Structured outputs with xgrammar: compile a request's grammar spec (JSON Schema, regex or EBNF) once per process,
then follow each constrained request token by token with a matcher that says which tokens may come next.

Where each part runs, and why:
- The front end compiles every spec before it admits the request, so a grammar that does not compile is a 400 that
  names the problem, and never reaches a worker.
- Every worker rank keeps one matcher per constrained request, next to its sampler. All ranks sample the same token,
  so their matchers stay in step without talking to each other (tensor parallelism needs nothing more).
- Compiled grammars are cached by spec in each process (the key is the spec text itself), so the same schema sent by
  many requests compiles once; a matcher is cheap to create from a compiled grammar.

The tokenizer's stop tokens are the model's EOS ids: the matcher allows them only once the grammar accepts the text so
far, so a constrained reply ends only where the grammar allows it to.

xgrammar (and through it torch and transformers) is imported on first use: a process that never sees a grammar does not
pay the import, and the HTTP process stays free of torch until its first constrained request.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import xgrammar

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "none")
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# JSON object mode (OpenAI's response_format {"type": "json_object"}) is this schema: any object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
COMPILE_CACHE_ENTRIES = 1024
MAX_SCHEMA_DEPTH = 64  # JSON nesting levels of a schema document (objects and arrays)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check's condition; a
# client needs neither.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+?:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}


class GrammarError(ValueError):
    """A grammar spec that does not compile; the message is fit for an HTTP 400."""


def _clean_error(kind: str, exc: Exception) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", message)).strip()
    # The JSON parser appends the whole schema after its message; the client sent it and does not need it back.
    message = message.split(" The JSON string is:")[0]
    return f"invalid {_KIND_NAMES[kind]}: {message}"


def _check_schema_depth(text: str) -> None:
    """Refuse schemas nested deeper than MAX_SCHEMA_DEPTH: xgrammar's compile time grows steeply with depth (a
    1000-level schema did not compile in two minutes), and one request must not tie up a compiler thread."""
    import json

    try:
        stack = [(json.loads(text), 1)]
    except RecursionError:
        raise GrammarError(f"invalid JSON schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: not JSON ({exc})") from None
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"invalid JSON schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


class GrammarCompiler:
    """One process's xgrammar compiler for one tokenizer, with a cache of compiled grammars keyed by spec.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's: the extra ids are never allowed.
    `stop_token_ids` are the ids that end generation (the model's EOS ids).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        max_threads: int = 1,
        cache_entries: int = COMPILE_CACHE_ENTRIES,
        unroll_bounded_strings: bool = True,
    ):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.unroll_bounded_strings = unroll_bounded_strings  # off: --disable-grammar-string-unrolling
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # xgrammar has its own cache too; ours is keyed by the spec text, bounded by count, and also remembers
        # failures so a client resending a bad schema does not recompile it.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()  # the front end may compile from a thread pool
        self.compilations = 0  # specs actually compiled (cache misses), for tests and metrics

    def compile(self, spec: tuple[str, str]) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of (kind, text); raises GrammarError if it does not compile."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
        if cached is None:
            cached = self._compile_uncached(*spec)
            with self._lock:
                self._cache[spec] = cached
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        if isinstance(cached, GrammarError):
            raise GrammarError(str(cached))  # a fresh exception: re-raising one instance would stack tracebacks
        return cached

    def _compile_uncached(self, kind: str, text: str):
        self.compilations += 1
        try:
            if kind == "json_schema":
                _check_schema_depth(text)
                return self._compiler.compile_grammar(_json_schema_grammar(text, self.unroll_bounded_strings))
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
        except GrammarError as exc:
            return exc
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError for some inputs)
            return GrammarError(_clean_error(kind, exc))
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")

    def matcher(self, spec: tuple[str, str], starts_after: int | None = None) -> "RequestGrammar":
        return RequestGrammar(self.compile(spec), self.vocab_size, starts_after)

    def check(self, spec: tuple[str, str]) -> None:
        """What the front end asks before admitting a request: the spec compiles, and its grammar lets the reply
        start at all (a schema such as {"minimum": 5, "maximum": 1} compiles to a grammar that admits nothing)."""
        if not self.matcher(spec).allowed_tokens().any():
            raise GrammarError(f"invalid {_KIND_NAMES[spec[0]]}: no text satisfies it")


def _json_schema_grammar(text: str, unroll_bounded_strings: bool):
    """xgrammar's grammar of a JSON schema, with the rewrites of radixserve/grammar_rewrites.py."""
    import xgrammar as xgr

    from radixserve import grammar_rewrites

    # Compact JSON (no free whitespace): a weak model cannot wander off into endless spaces and newlines.
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    ebnf = grammar_rewrites.forbid_raw_control_characters(str(grammar))
    if unroll_bounded_strings:
        ebnf = grammar_rewrites.unroll_bounded_strings(ebnf)
    return grammar if ebnf == str(grammar) else xgr.Grammar.from_ebnf(ebnf)


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next, advanced with every sampled token.

    `starts_after` (a token id) holds the grammar back until that token is sampled: with a reasoning parser the
    schema is the answer's, and the thinking before </think> is free (vLLM starts structured output there too)."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar", vocab_size: int, starts_after: int | None = None):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.broken = False  # a token the grammar rejected was forced in; the request is no longer constrained
        self.waiting_for = starts_after  # None once the grammar applies

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may be generated."""
        return self._matcher.is_terminated()

    @property
    def active(self) -> bool:
        return self.waiting_for is None and not self.broken and not self._matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it (then the matcher stops constraining)."""
        if self.waiting_for is not None:  # still before the grammar's start: the start token itself is not its text
            if int(token) == self.waiting_for:
                self.waiting_for = None
            return True
        if not self.active:
            return False
        if not self._matcher.accept_token(int(token)):
            self.broken = True
            return False
        return True

    def accept_all(self, tokens) -> None:
        """Replay tokens already generated (a request re-registered after a retraction)."""
        for token in tokens:
            if not self.accept(int(token)):
                break

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_tokens(self) -> "torch.Tensor":
        """Bool mask [vocab] of the tokens allowed next (for tests and debugging; the sampler uses the bitmask)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return unpack_bitmask(bitmask[0], self.vocab_size)


def allocate_bitmask(rows: int, vocab_size: int) -> "torch.Tensor":
    """int32 [rows, ceil(vocab/32)] on the CPU: bit j of word w allows token 32*w + j."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


_batch_matcher = None  # xgrammar's thread pool for filling many rows at once, made on first use


def fill_bitmasks(grammars: list[RequestGrammar], bitmask: "torch.Tensor", rows: list[int]) -> None:
    """Fill bitmask row rows[i] from grammars[i]. Rows are filled in parallel threads: a fill is CPU work of up to a
    few hundred microseconds, and a large constrained batch would otherwise add that much per row to every step."""
    global _batch_matcher
    import xgrammar as xgr

    if len(grammars) < 2:
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)
        return
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher()
    _batch_matcher.batch_fill_next_token_bitmask([g._matcher for g in grammars], bitmask, indices=rows)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids, in the given rows only (bitmask [B, words]
    filled at those rows); the other rows are not touched."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[1], indices=rows
    )


def unpack_bitmask(words: "torch.Tensor", vocab_size: int) -> "torch.Tensor":
    import torch

    bits = (words.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


class WorkerGrammars:
    """A worker rank's source of matchers. The tokenizer and compiler are loaded on the first constrained request, so
    a server that never sees one pays nothing at startup; later requests with the same spec reuse its compilation.
    `backend` "none" (--grammar-backend none) constrains nothing; the front end refuses such requests first."""

    def __init__(
        self,
        backend: str,
        tokenizer_path,
        vocab_size: int,
        stop_token_ids: list[int],
        unroll_bounded_strings: bool = True,
    ):
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"--grammar-backend must be one of {GRAMMAR_BACKENDS}, got {backend!r}")
        self.backend = backend
        self._tokenizer_path = str(tokenizer_path)
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._unroll_bounded_strings = unroll_bounded_strings
        self._compiler: GrammarCompiler | None = None

    def matcher(self, params, generated=()) -> RequestGrammar | None:
        """The matcher of a request (SamplingParams) that is constrained, advanced past `generated` (the outputs it
        already has after a retraction); None for an unconstrained request."""
        spec = params.grammar_spec
        if spec is None or self.backend == "none":
            return None
        if self._compiler is None:
            from radixserve.tokenizer_loading import load_tokenizer

            tokenizer = load_tokenizer(self._tokenizer_path)
            self._compiler = GrammarCompiler(
                tokenizer, self._vocab_size, self._stop_token_ids, unroll_bounded_strings=self._unroll_bounded_strings
            )
        try:
            grammar = self._compiler.matcher(spec, params.grammar_starts_after)
        except GrammarError as e:
            # The HTTP front end compiles every spec before admission, so only a caller that skipped that check
            # (e.g. the offline Engine) gets here: that one request goes unconstrained rather than the worker down.
            logger.error("request left unconstrained: %s", e)
            return None
        grammar.accept_all(generated)
        return grammar
