"""The start-up check of piece-wise chat tokenization (chat_segments.py): sample conversations rendered by the
server's chat template and tokenized both ways, piece by piece (cold, then from the cache) and whole, as
`apply_chat_template` tokenizes them. Any difference, and the server tokenizes chat prompts whole (tokenization.py
logs why).

The samples aim at the places where pieces meet: whitespace and newlines on both sides of every message, empty
messages, text that decomposes or composes under NFC, digits, CJK, emoji, a special token's text inside a message,
multi-turn chats, tool calls and their results, a thinking block, and an open final message.
"""

from __future__ import annotations

import copy

from tokenizer_service.chat_segments import SegmentEncoder
from tokenizer_service.segment_cache import SegmentCache
from tokenizer_service.structured_outputs import chat_template_inputs

_EDGES = " \n  Cafe\u0301 na\u00efve 你好 🙂\t\r\n 2024-12-31 x=1234567 <|im_end|><|im_start|> end.  \n\n"
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def sample_conversations() -> list[tuple[list[dict], list[dict] | None, dict]]:
    """(messages, tools, apply_chat_template options) of each sample."""
    system = {"role": "system", "content": "You are a careful assistant.\n\nRules:\n 1. Be brief. " + _EDGES}
    user = {"role": "user", "content": _EDGES}
    reply = {"role": "assistant", "content": "<think>\nWeighing it.\n</think>\n\n Sure:" + _EDGES}
    turns = [system, user, reply, {"role": "user", "content": "\n and then?  "}]
    return [
        ([system, user], None, {"add_generation_prompt": True}),
        ([{"role": "user", "content": ""}], None, {"add_generation_prompt": True}),
        ([{"role": "system", "content": ""}, {"role": "user", "content": " "}], None, {"add_generation_prompt": False}),
        (turns, None, {"add_generation_prompt": True}),
        (turns, None, {"add_generation_prompt": True, "enable_thinking": False}),
        (
            [
                system,
                user,
                {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                {"role": "tool", "content": " 18 C, clear ", "tool_call_id": "call_1"},
            ],
            [_TOOL],
            {"add_generation_prompt": True},
        ),
        (
            [system, user, {"role": "assistant", "content": " The answer is"}],
            None,
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ]


def check_segments(tokenizer, backend) -> str | None:
    """Why piece-wise ids differ from whole ids on a sample (the first difference), or None when they agree on
    every sample that the template renders. `backend`: the Rust tokenizer the server encodes pieces with."""
    encoder = SegmentEncoder(backend, SegmentCache(1 << 24, tuple(range(backend.get_vocab_size(True)))))
    rendered_any = False
    for number, (messages, tools, options) in enumerate(sample_conversations()):
        messages, tool_options = chat_template_inputs(copy.deepcopy(messages), tools, tokenizer)
        kwargs = {**options, **tool_options}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            whole = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))
        except Exception:  # noqa: BLE001 - a template may refuse a sample (roles must alternate, no system role)
            continue
        rendered_any = True
        for attempt in ("cold", "cached"):
            pieces = encoder.encode(text, None)
            if pieces != whole:
                at = next((i for i, (a, b) in enumerate(zip(pieces, whole)) if a != b), min(len(pieces), len(whole)))
                return (
                    f"sample conversation {number} ({attempt}): piece-wise ids differ from whole-prompt ids at "
                    f"token {at} of {len(whole)}"
                )
    if not rendered_any:
        return "the chat template rendered none of the sample conversations"
    return None
