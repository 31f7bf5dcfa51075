"""--reasoning-parser: the <think>...</think> block a reasoning model writes before its answer, split off the reply as
`reasoning_content` (chat, `delta.reasoning_content` when streamed) or a reasoning item (/v1/responses).

Where a reply starts is read from the end of its prompt, the chat template's generation prompt:
    open    the template opened the block (DeepSeek-R1, Qwen3 thinking-2507 end it with <think>), or the parser is
            deepseek-r1, whose models think first whether or not they write <think>: all is reasoning until
            </think> (a leading <think> of the model's own is dropped), so a reply cut by max_tokens is all reasoning
    maybe   Qwen3 (hybrid): the reply is reasoning only if the model opens it with <think> (or closes an empty one
            with </think> at once); otherwise it is all content
    closed  the template wrote an empty block already (Qwen3 with enable_thinking false ends with </think>): all
            content, whatever it says

Tool calls and every other shaping of the content (structured_outputs.ChatTools) apply to the content after the
reasoning. A response_format (or a tool_choice enforced by a schema) constrains the answer, not the thinking: unless
the reply starts closed, its grammar waits for the </think> token (SamplingParams.grammar_starts_after, as vLLM
starts structured output after the reasoning). A regex or EBNF still holds the whole reply, thinking included, so a
client can shape both.

Whole replies are split by running the streaming splitter over the whole text, so that streamed deltas always add up
to the whole split. Blank lines around the reasoning, and after </think>, are dropped: Qwen3's template writes them
back itself when the turn is rendered again.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek-r1")
THINK_START, THINK_END = "<think>", "</think>"
OPEN, MAYBE, CLOSED = "open", "maybe", "closed"
PROMPT_TAIL_TOKENS = 8  # enough to see the generation prompt's <think> or </think> and the blank lines after it

# Splitter states: before the first visible character (does the reply open with a tag?), in the reasoning, in the
# content.
_HEAD, _REASONING, _CONTENT = "head", "reasoning", "content"


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of text that is the start of tag (a tag cut between two pieces)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplitter:
    """One reply's text, fed piece by piece, split into (reasoning, content) pieces. `reasoning` and `content` hold
    everything emitted so far; `closed` says whether </think> was seen."""

    def __init__(self, start: str):
        self.start = start
        self._state = _CONTENT if start == CLOSED else _HEAD
        self._pending = ""  # not assigned yet: a possible tag, or blank space that may turn out to end the reasoning
        self._lead = False  # drop the blank space that begins what comes next
        self.reasoning, self.content, self.closed = "", "", False

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, content = self._step()
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply has ended."""
        pending, self._pending = self._pending, ""
        reasoning = content = ""
        if self._state == _HEAD:  # the reply ended before it showed what it was (or was only blank space)
            if self.start == OPEN:
                reasoning = pending.strip()
            else:
                content = pending
        elif self._state == _REASONING:
            reasoning = pending.strip() if self._lead else pending.rstrip()
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _step(self) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self._state == _HEAD:
                head = self._pending.lstrip()
                if not head or any(tag.startswith(head) and tag != head for tag in (THINK_START, THINK_END)):
                    return reasoning, content  # not decided yet
                if head.startswith(THINK_START):
                    self._state, self._pending, self._lead = _REASONING, head[len(THINK_START) :], True
                elif head.startswith(THINK_END):  # an empty block, closed at once
                    self._state, self._pending, self._lead, self.closed = _CONTENT, head[len(THINK_END) :], True, True
                elif self.start == OPEN:
                    self._state, self._pending = _REASONING, head
                else:
                    self._state = _CONTENT  # no reasoning: the content as written, blank start included
                continue
            if self._lead:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return reasoning, content
                self._lead = False
            if self._state == _CONTENT:
                content += self._pending
                self._pending = ""
                return reasoning, content
            end = self._pending.find(THINK_END)
            if end >= 0:
                reasoning += self._pending[:end].rstrip()
                self._state, self._pending, self._lead, self.closed = (
                    _CONTENT,
                    self._pending[end + len(THINK_END) :],
                    True,
                    True,
                )
                continue
            # Hold back a tag cut between pieces, and blank space that is the reasoning's end if </think> follows.
            cut = len(self._pending) - _partial_tag_length(self._pending, THINK_END)
            ready = self._pending[:cut].rstrip()
            reasoning += ready
            self._pending = self._pending[len(ready) :]
            return reasoning, content


class ReasoningReply:
    """A chat reply's reasoning split off, then its content shaped by ChatTools (content and tool calls), with the
    interface the routes use on ChatTools: `message` for a whole reply, `stream_delta` for each streamed output."""

    def __init__(self, tools, start: str):
        self.tools, self.start = tools, start
        self._splitters: dict[int, ReasoningSplitter] = {}  # by choice index

    def split(self, text: str) -> tuple[str, str]:
        splitter = ReasoningSplitter(self.start)
        splitter.feed(text)
        splitter.finish()
        return splitter.reasoning, splitter.content

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        reasoning, content = self.split(text)
        message, finish_reason = self.tools.message(content, finish_reason)
        if reasoning:
            message["reasoning_content"] = reasoning
            message["content"] = message["content"] or None  # a reply cut inside its reasoning has no content
        return message, finish_reason

    def stream_delta(self, index: int, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.start))
        reasoning, content = splitter.feed(text)
        if finished:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta, finish_reason = self.tools.stream_delta(index, content, finished, finish_reason)
        if reasoning:
            if not delta.get("content"):
                delta.pop("content", None)
            delta = {"reasoning_content": reasoning, **delta}
        return delta, finish_reason


class ReasoningParser:
    """The server's --reasoning-parser: where each reply starts, and the token its grammar waits for."""

    def __init__(self, name: str, tokenizer, token_text):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
        vocab = tokenizer.get_vocab()
        if THINK_END not in vocab:
            raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {THINK_END} token")
        self.name = name
        self.end_token_id = vocab[THINK_END]
        self.token_text = token_text  # one token's text, cached (ServingContext.token_text)

    def start_of_reply(self, prompt_ids: list[int]) -> str:
        tail = "".join(self.token_text(t) for t in prompt_ids[-PROMPT_TAIL_TOKENS:]).rstrip()
        if tail.endswith(THINK_START):
            return OPEN
        if tail.endswith(THINK_END):
            return CLOSED
        return OPEN if self.name == "deepseek-r1" else MAYBE

    def reply(self, tools, prompt_ids: list[int], fields: dict) -> ReasoningReply:
        """The reply shaping of a chat request with this prompt; `fields` (its sampling fields) get the grammar's
        start when a JSON schema (response_format, or a tool_choice that must be obeyed) is to hold the answer."""
        start = self.start_of_reply(prompt_ids)
        if start != CLOSED and fields.get("json_schema") is not None:
            fields["grammar_starts_after"] = self.end_token_id
        return ReasoningReply(tools, start)
