"""Rewrites of the EBNF that xgrammar writes for a JSON schema, made before it is compiled.

- `forbid_raw_control_characters` changes the language, to JSON's: xgrammar (0.2.8) writes the characters of a
  string with minLength/maxLength as [^"\\\r\n], which lets raw control characters (U+0000-U+001F) into a JSON string
  where JSON forbids them, and strict parsers (Python's json) refuse the reply. Its unbounded strings already exclude
  them; bounded ones get the same class here.
- `unroll_bounded_strings` keeps the language and changes only how fast a token mask is filled. xgrammar writes a
  string of at most n characters as `"\"" chars{m, n} "\""`, and in such a repetition the tokens a step allows depend
  on how many characters are left, which xgrammar's per-position mask cache cannot know: every content token is
  checked again on every step (0.73 ms a fill for the structured-outputs benchmark's schema on the Qwen3 vocabulary,
  30x an unbounded string's). Written instead as a chain of rules, one per number of characters left, each with the
  closing quote as its lookahead, each position is a rule of its own whose mask xgrammar computes at compile time:
  0.035 ms a fill (21x less) and a faster compile (2.7 s against 3.7 s) for the same replies.
"""

from __future__ import annotations

import re

_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"  # as xgrammar prints its EBNF
_BOUNDED_STRING_CHAR_FIXED = r"[^\0-\x1f\"\\\r\n]"

# `"\"" NAME{m, n} "\""` in a rule body: the characters of a bounded string, then its closing quote.
_BOUNDED_REPEAT = re.compile(r'(\w+)\{(\d+), (\d+)\} "\\""')
_CHARACTER_CLASS_BODY = re.compile(r"\(\(\[(?:[^\]\\]|\\.)*\]\)\)")
# Longer strings stay as xgrammar wrote them: a rule per character left costs compile time and memory.
MAX_UNROLLED_CHARACTERS = 512


def forbid_raw_control_characters(text: str) -> str:
    return text.replace(_BOUNDED_STRING_CHAR, _BOUNDED_STRING_CHAR_FIXED)


def unroll_bounded_strings(text: str) -> str:
    """`NAME{m, n} "\""` (NAME one character class) -> m x NAME, then NAME__left{n-m} "\"", where NAME__left{k} is
    empty or NAME followed by NAME__left{k-1}, and is always followed by the closing quote."""
    lines = text.splitlines()
    bodies = dict(line.split(" ::= ", 1) for line in lines if " ::= " in line)
    chains: dict[str, int] = {}  # character rule -> the longest chain it needs

    def unrolled(match: re.Match) -> str:
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if not _CHARACTER_CLASS_BODY.fullmatch(bodies.get(name, "")) or high - low > MAX_UNROLLED_CHARACTERS:
            return match.group(0)
        if high == low:
            return " ".join([name] * low + ['"\\""'])
        chains[name] = max(chains.get(name, 0), high - low)
        return " ".join([name] * low + [f"{name}__left{high - low}", '"\\""'])

    out = [_BOUNDED_REPEAT.sub(unrolled, line) for line in lines]
    for name, longest in chains.items():
        for left in range(1, longest + 1):
            rest = f" {name}__left{left - 1}" if left > 1 else ""
            out.append(f'{name}__left{left} ::= ("" | ({name}{rest})) (="\\"")')
    return "\n".join(out)
