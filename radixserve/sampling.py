"""Per-request sampling parameters: a msgspec Struct so that it travels inside socket messages unchanged."""

from __future__ import annotations

import math

import msgspec

MAX_TOP_LOGPROBS = 20


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
    stop: list[str] = []  # stop strings: matched on text by the detokenizer
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob plus the top k

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

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
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})")
