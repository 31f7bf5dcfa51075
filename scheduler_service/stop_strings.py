"""Stop strings, decided by the scheduler: it frees the request's KV the step a stop string appears and computes
nothing past it. The front end only trims the text it shows (or keeps it, with include_stop_str_in_output).

Each check decodes a bounded tail of the output: the longest stop string in UTF-8 bytes plus a few tokens. A
byte-level or byte-fallback tokenizer gives every token at least one byte, so a match ending in the newest token
lies wholly inside that tail; the extra tokens absorb special tokens that decode to nothing and keep the window's
first token (which some tokenizers decode without its leading space) away from any match.
"""

from __future__ import annotations

from typing import Sequence

WINDOW_SLACK_TOKENS = 3
# What a decode of an incomplete UTF-8 sequence shows; it turns into a real character once the next byte comes.
REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes and every token at least one: an incomplete one spans at most 3 tokens.
MAX_INCOMPLETE_CHAR_TOKENS = 3


class StopStringMatcher:
    """One request's stop strings. find() after each new token: the string that just appeared, or None."""

    def __init__(self, tokenizer, stop: Sequence[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.window = max(len(s.encode()) for s in self.stop) + WINDOW_SLACK_TOKENS if self.stop else 0

    def find(self, output_ids: list[int], final: bool = False) -> str | None:
        """The stop string that the last token of output_ids completed; never one that was already whole before it
        (that one was seen, or ignored under min_new_tokens, one step earlier). The prompt is not searched.

        Only text that can no longer change is searched (see _settled_len); final=True, for the last token the
        request will get, takes the text as it is."""
        if not self.stop or not output_ids:
            return None
        tail = output_ids[-self.window :]
        text = self._decode(tail)
        settled = len(text) if final else self._settled_len(tail, text)
        before = self._settled_len(tail[:-1], self._decode(tail[:-1])) if len(tail) > 1 else 0
        best = None
        for s in self.stop:
            at = text.find(s, max(0, before - len(s) + 1), settled)
            # Of several strings completed by one token, the one that ends the text earliest wins; of those ending
            # at the same character, the one starting earliest (the front end cuts the text where it starts).
            if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
                best = (at + len(s), at, s)
        return best[2] if best else None

    def _settled_len(self, ids: list[int], text: str) -> int:
        """How much of text (the decode of ids) later tokens cannot change. A trailing U+FFFD may be a character
        whose remaining bytes are still to come (only a stop string containing U+FFFD could match it). Such a
        character starts within the last MAX_INCOMPLETE_CHAR_TOKENS tokens; a split point there whose halves decode
        to the same text separately as together leaves a left half that nothing after it can join (the front end's
        detokenizer shows text by the same rule, so both agree on what a U+FFFD is)."""
        if not text.endswith(REPLACEMENT_CHAR):
            return len(text)
        for split in range(len(ids) - 1, max(0, len(ids) - 1 - MAX_INCOMPLETE_CHAR_TOKENS), -1):
            left = self._decode(ids[:split])
            if left + self._decode(ids[split:]) == text:
                return len(left)
        return len(text.rstrip(REPLACEMENT_CHAR))

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: the front end's detokenizer decodes the same way, so both see the same text.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
