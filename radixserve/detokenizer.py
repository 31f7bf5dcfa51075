"""Incremental detokenization with stop-string trimming, one instance per generated sequence.

The scheduler sends token ids; clients want text, a piece at a time. Two things make this harder than
`decode(new_ids)`:

* Byte-level BPE tokens (GPT-2, Llama-3, Qwen) and SentencePiece byte-fallback tokens can end in the
  middle of a UTF-8 character ("😀" may be three tokens). Decoding such a prefix yields U+FFFD. Text is
  emitted only when the pending tokens end on a character boundary, decoded after a few emitted tokens
  as context (so that tokenizers which strip a leading space see the same neighbourhood as a full
  decode). This is the prefix/read-offset scheme of vLLM and SGLang, run by the `tokenizers` library's
  own `DecodeStream` in Rust: ~1 us a token, where two calls of the tokenizer's Python `decode` a token
  cost ~9 us (1.1 ms a step for 128 streams). One case the stream leaves unbounded: tokens that never
  complete a character (invalid bytes) keep every step's decode ending in U+FFFD; past a few such
  tokens we find a stable split point ourselves, emit up to it, and restart the stream there.
* Stop strings end a sequence where the scheduler says (it decides every finish and sends the stop string that
  matched with the last token, scheduler_service/stop_strings.py); the text shown must not contain it. A stop
  string can span several tokens or start inside a token, so text that could still become the start of one is
  held back until it is known not to be: a streaming client never sees part of a stop string that is then cut.
  When the sequence finishes on a stop string, finish(stop) cuts the text where that string begins (or ends,
  with include_stop_str_in_output). A complete stop string the scheduler did not stop at (it ignores them below
  min_new_tokens) is ordinary text.

With the scheduler stopping at the first character that completes any stop string, the concatenation of all
`text` deltas (including `finish()`) equals `tokenizer.decode(output_ids)` cut at that stop string, for
byte-level BPE and byte-fallback tokenizers (decode = UTF-8 with replacement, a prefix-consistent function).
Decoding uses `clean_up_tokenization_spaces=False`: the clean-up rewrites " ." depending on what follows,
which can never be streamed consistently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context in front of the first generated token (vLLM uses the same number).
# Enough for tokenizers whose decode of a token depends on its left neighbour.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character has at most 4 bytes and every byte-level token carries at least one byte, so an
# incomplete trailing character lies within the last 3 tokens. When more tokens than that are pending
# and the text still ends in U+FFFD, we look among the last few split points for one that is a stable
# character boundary; without this a run of invalid bytes would grow the window without limit.
MAX_INCOMPLETE_CHAR_TOKENS = 3


@dataclass(frozen=True, slots=True)
class DetokenizerDelta:
    text: str  # new text the client may see now ("" when everything is held back)
    stopped: bool  # the sequence finished on a stop string; further tokens are ignored
    matched_stop: str | None  # the stop string that ended the sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, hiding stop strings.

    `tokenizer` is a Hugging Face fast tokenizer (its Rust `backend_tokenizer` decodes) or a `tokenizers.Tokenizer`.
    `prompt_ids` supplies left context only; it is never part of the output.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop_strings: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # decodes without transformers' Python
        self.skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; duplicates only cost time.
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._include_stop = include_stop_str_in_output

        # A prompt ending inside a character: its tail cannot serve as clean context, and the output's first
        # bytes then decode on their own, as `decode(output_ids)` does.
        # (the tail sliced before the conversion: a 1,500-token prompt converted whole cost ~45 us a request)
        context = self._clean_context(_as_int_list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._context: list[int] = context  # the last few emitted tokens (prompt tokens at first)
        self._pending: list[int] = []  # fed to the stream, text not yet emitted
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)

        # Text that passed the UTF-8 stage but is held back as a possible stop-string start.
        self._held = ""
        self._pieces: list[str] = []  # everything emitted, for `output_text`
        self._stopped = False
        self._matched_stop: str | None = None
        self._flushed = False

    # ----------------------------------------------------------------------------------------- public

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def window_size(self) -> int:
        """Token ids a step may decode (context + pending); stays small, see module doc."""
        return len(self._context) + len(self._pending)

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of the deltas). O(length): not for every token."""
        return "".join(self._pieces)

    def add_tokens(self, new_ids: Sequence[int]) -> DetokenizerDelta:
        """Feed newly generated token ids; returns the text that became safe to show."""
        if self._stopped or self._flushed:
            return self._delta("")
        new_ids = _as_int_list(new_ids)
        if not new_ids:
            return self._delta("")
        buffer = self._held + self._next_stable_text(new_ids)
        hold = self._partial_stop_suffix_len(buffer)
        self._held = buffer[len(buffer) - hold :]
        return self._delta(buffer[: len(buffer) - hold])

    def finish(self, matched_stop: str | None = None, last_ids: Sequence[int] = ()) -> DetokenizerDelta:
        """End of generation, with the sequence's last token ids if they came with the finish: release everything
        held back, including an incomplete trailing character (as U+FFFD, exactly as a full decode shows it).
        With `matched_stop`, the stop string the scheduler stopped at, the text is cut where it begins (kept up to
        its end with include_stop_str_in_output); the last ids come here rather than through add_tokens, which
        would show a complete stop string as text."""
        if self._stopped or self._flushed:
            return self._delta("")
        self._flushed = True
        pending = self._pending + _as_int_list(last_ids)
        shown_held = len(self._held)
        text = self._held + self._decode(self._context + pending)[len(self._decode(self._context)) :]
        self._held = ""
        self._context, self._pending = [], []
        if matched_stop:
            self._stopped, self._matched_stop = True, matched_stop
            start = self._stop_start(text, shown_held, matched_stop)
            if start is not None:
                text = text[: start + len(matched_stop)] if self._include_stop else text[:start]
        return self._delta(text)

    def flush(self) -> DetokenizerDelta:
        """End of generation for a reason other than a stop string (length, a stop token)."""
        return self.finish(None)

    # ------------------------------------------------------------------------------ UTF-8 stage

    def _decode(self, ids: Sequence[int]) -> str:
        # The Rust decode leaves spaces as they are (transformers' clean_up_tokenization_spaces=False).
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _next_stable_text(self, new_ids: list[int]) -> str:
        """Text of the pending tokens that can no longer change, new_ids included."""
        self._pending += new_ids
        try:
            text = self._stream.step(self._backend, new_ids if len(new_ids) > 1 else new_ids[0])
        except Exception:  # the decode is not prefix-consistent here: wait for more tokens, as on U+FFFD
            text = None
        if text is not None:
            self._emitted(len(self._pending))
            return text
        if len(self._pending) <= MAX_INCOMPLETE_CHAR_TOKENS:
            return ""  # usually a character still being completed by the next tokens
        return self._split_long_run()

    def _clean_context(self, ids: list[int]) -> list[int]:
        """ids as decoding context, or none if they end inside a character or in invalid bytes (U+FFFD): the
        stream cannot start after such a tail, and text after a stable boundary decodes the same on its own."""
        return [] if ids and self._decode(ids).endswith(REPLACEMENT_CHAR) else ids

    def _emitted(self, count: int) -> None:
        """The first `count` pending tokens are emitted: they become the context."""
        self._context = (self._context + self._pending[:count])[-PROMPT_CONTEXT_TOKENS:]
        del self._pending[:count]

    def _split_long_run(self) -> str:
        """A long run of pending tokens whose decode still ends in U+FFFD (invalid bytes, or characters chained
        across tokens). A split point is a stable boundary when decoding both halves separately gives the same
        text as decoding them together: then the left half's bytes cannot combine with anything that follows.
        Emit up to the last such point and restart the stream after it."""
        window = self._context + self._pending
        prefix_text = self._decode(self._context)
        full_text = self._decode(window)
        lowest = max(len(self._context) + 1, len(window) - MAX_INCOMPLETE_CHAR_TOKENS)
        for split in range(len(window) - 1, lowest - 1, -1):
            left_text = self._decode(window[:split])
            if left_text + self._decode(window[split:]) == full_text:
                if not left_text.startswith(prefix_text):
                    return ""  # tokenizer not decoding prefix-consistently here: wait, stay correct
                self._emitted(split - len(self._context))
                self._context = self._clean_context(self._context)
                self._stream = DecodeStream(self._context, skip_special_tokens=self.skip_special_tokens)
                if self._pending:
                    self._stream.step(self._backend, self._pending)  # (ends in U+FFFD: no text yet)
                return left_text[len(prefix_text) :]
        return ""

    # ------------------------------------------------------------------------- stop-string stage

    @staticmethod
    def _stop_start(text: str, held: int, stop: str) -> int | None:
        """Where the stop string the scheduler matched begins in `text` (held-back text, then the rest). It was
        completed by the last tokens, so it ends past the held part; it cannot begin in text already shown, as
        every possible start of a stop string is held back. None if the text does not contain it (a tokenizer
        whose decode of the scheduler's window differs from ours): then nothing is cut."""
        start = text.find(stop, max(0, held - len(stop) + 1))
        if start < 0:
            start = text.find(stop)
        return start if start >= 0 else None

    def _partial_stop_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _delta(self, text: str) -> DetokenizerDelta:
        if text:
            self._pieces.append(text)
        return DetokenizerDelta(text=text, stopped=self._stopped, matched_stop=self._matched_stop)


def _as_int_list(ids) -> list[int]:
    # Token ids arrive as numpy int32 arrays from the scheduler socket; tokenizers want Python ints.
    if hasattr(ids, "tolist"):
        return ids.tolist()
    return [int(i) for i in ids]
