"""A rendered chat prompt tokenized piece by piece, each piece's ids cached by its text (segment_cache.py).

Why it is exact: the Rust tokenizer (HF `tokenizers`) first cuts the text at every added token that matches the raw
text (`normalized: false`; <|im_start|>, <|im_end|> and the like), leftmost-longest, and from then on treats each
piece between them alone: normalizer, pre-tokenizer and model all run per piece, and with add_special_tokens off the
post-processor adds nothing. Cutting the text at the same places ourselves and encoding each piece alone therefore
gives the same ids, in the same order, as encoding the whole text. Chat templates write such tokens between messages,
so a system prompt (or an earlier turn) is one piece, whose ids a later request finds in the cache by its text.

What could break it, and is refused up front (`segment_problem`) or caught by the start-up check
(segment_check.py): an added token with lstrip / rstrip / single_word (the cut then depends on the text around it),
`split_special_tokens` (special tokens are then text), a pre-tokenizer that treats the start of the whole text
differently from the start of a piece (Metaspace with prepend_scheme "first": the check catches it).

The cut itself: a regex built as a trie of the added tokens' texts, so that at each position the longest token that
starts there wins (as in the tokenizer's Aho-Corasick, MatchKind::LeftmostLongest), in time bounded by the longest
token rather than by how many there are.
"""

from __future__ import annotations

import re
from concurrent.futures import Future

from tokenizer_service.segment_cache import SegmentCache


def _trie_regex(words: list[str]) -> str:
    """A regex matching, at a position, the longest of `words` that starts there."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # A word ending here is the shorter match: the greedy `?` tries the longer ones first.
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)


def segment_problem(tokenizer) -> str | None:
    """Why piece-wise ids could differ from whole-text ids for this tokenizer, or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return "the tokenizer has no Rust (tokenizers) backend"
    if getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
        return "split_special_tokens is on (special tokens are encoded as text)"
    for token in backend.get_added_tokens_decoder().values():
        if not token.normalized and (token.lstrip or token.rstrip or token.single_word):
            return f"added token {token.content!r} strips whitespace or matches single words only"
    return None


class SegmentEncoder:
    """Encodes rendered chat prompts piece by piece through a SegmentCache. Thread-safe: the Rust tokenizer's
    encode_batch only reads it (and releases the GIL while it runs), the cache has its own lock."""

    def __init__(self, backend, cache: SegmentCache):
        self.backend, self.cache = backend, cache
        # Only the tokens matched on the raw text cut it; `normalized: true` ones are matched inside each piece, the
        # same way whether the piece is encoded alone or in the whole text.
        cuts = {
            t.content: backend.token_to_id(t.content)
            for t in backend.get_added_tokens_decoder().values()
            if not t.normalized and t.content
        }
        self._token_ids = cuts
        self._cut = re.compile(_trie_regex(sorted(cuts))) if cuts else None

    def split(self, text: str) -> list[str | int]:
        """The text as pieces of text and the ids of the added tokens between them, in order."""
        if self._cut is None:
            return [text] if text else []
        parts: list[str | int] = []
        start = 0
        for match in self._cut.finditer(text):
            if match.start() > start:
                parts.append(text[start : match.start()])
            parts.append(self._token_ids[match.group()])
            start = match.end()
        if start < len(text):
            parts.append(text[start:])
        return parts

    def encode(self, text: str, namespace: str | None) -> list[int]:
        """The ids of `text` (add_special_tokens off, as a rendered chat template is encoded); pieces seen before in
        this namespace (the request's cache_salt) come from the cache, new ones are encoded in one batch."""
        parts = self.split(text)
        cache = self.cache
        found: dict[str, tuple[int, ...]] = {}
        waiting: dict[str, Future] = {}  # pieces another request is encoding right now
        claimed: list[str] = []  # new pieces, each once, for this request to encode
        for piece in dict.fromkeys(part for part in parts if isinstance(part, str)):
            got = cache.claim(namespace, piece)
            if got is None:
                claimed.append(piece)
            elif isinstance(got, Future):
                waiting[piece] = got
            else:
                found[piece] = got
        if claimed:
            try:
                encoded = self.backend.encode_batch(claimed, add_special_tokens=False)
                for piece, encoding in zip(claimed, encoded):
                    found[piece] = cache.put(namespace, piece, encoding.ids)
            except BaseException as e:  # nobody may wait forever for a piece this request claimed
                cache.abandon(namespace, claimed, e)
                raise
        for piece, future in waiting.items():  # only after this request's own claims are settled
            found[piece] = future.result()
        return _joined(parts, found)

    def encode_known(self, text: str, namespace: str | None, max_new_chars: int) -> list[int] | None:
        """encode() for the event loop: the ids when the pieces not cached yet total at most max_new_chars (those
        encoded here, in one small batch); None, having claimed and encoded nothing, when there is more new text,
        for the pool to encode. Never waits: a new piece that another request is encoding right now is encoded
        here too (it is short), and its ids are not put a second time."""
        parts = self.split(text)
        cache = self.cache
        found: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        for piece in dict.fromkeys(part for part in parts if isinstance(part, str)):
            got = cache.lookup(namespace, piece)
            if got is None:
                missing.append(piece)
            else:
                found[piece] = got
        if sum(map(len, missing)) > max_new_chars:
            return None
        if missing:
            claims = [cache.claim(namespace, piece) for piece in missing]
            to_encode = [piece for piece, got in zip(missing, claims) if not isinstance(got, tuple)]
            found.update((piece, got) for piece, got in zip(missing, claims) if isinstance(got, tuple))
            mine = [piece for piece, got in zip(missing, claims) if got is None]
            try:
                encoded = self.backend.encode_batch(to_encode, add_special_tokens=False) if to_encode else []
            except BaseException as e:
                cache.abandon(namespace, mine, e)
                raise
            claimed = set(mine)
            for piece, encoding in zip(to_encode, encoded):
                found[piece] = cache.put(namespace, piece, encoding.ids) if piece in claimed else encoding.ids
        return _joined(parts, found)


def _joined(parts: list[str | int], found: dict[str, tuple[int, ...]]) -> list[int]:
    """The ids of split() parts: each piece's ids from `found`, the added tokens' ids as they are."""
    out: list[int] = []
    for part in parts:
        if isinstance(part, int):
            out.append(part)
        else:
            out.extend(found[part])
    return out
