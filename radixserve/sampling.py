"""Per-request sampling parameters: a msgspec Struct so that it travels inside socket messages unchanged."""

from __future__ import annotations

import math

import msgspec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_LOGIT_BIAS_ENTRIES = 1024


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []  # stop strings: the scheduler stops at them, the front end cuts them from the text
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob plus the top k
    # Logprobs of the prompt's own tokens (vLLM's name), each with the top k; /v1/completions echo sets it. The whole
    # prompt is computed for them: a cached prefix has no logits (the scheduler skips the radix match).
    prompt_logprobs: int | None = None
    # Structured output: at most one grammar spec (radixserve/grammar.py compiles it with xgrammar).
    json_schema: str | None = None  # JSON Schema text
    regex: str | None = None
    ebnf: str | None = None  # GBNF/EBNF grammar text, root rule `root`
    logit_bias: dict[int, float] = {}  # token id -> value added to its logit before sampling
    # The grammar constrains only what follows this token: with --reasoning-parser, a response_format holds the answer
    # after </think>, not the thinking before it (vLLM's order). None: from the first token.
    grammar_starts_after: int | None = None

    @property
    def grammar_spec(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar this request is constrained by, or None. Also the compile-cache key."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message fit for an HTTP 400."""

        def bad(msg: str):
            raise ValueError(msg)

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad(f"max_tokens must be a non-negative integer, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            bad(f"min_tokens must be in [0, max_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a non-negative number, got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if math.isnan(value) or not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2], got {value}")
        if math.isnan(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if sum(x is not None for x in (self.json_schema, self.regex, self.ebnf)) > 1:
            bad("at most one of json_schema, regex and ebnf may be given")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            bad(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if math.isnan(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bad(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token}"
                )
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                bad(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")
        if self.grammar_starts_after is not None and not 0 <= self.grammar_starts_after < (vocab_size or 2**31):
            bad(f"grammar_starts_after must be a token id of the vocabulary, got {self.grammar_starts_after}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})")
