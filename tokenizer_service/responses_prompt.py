"""The prompt of a /v1/responses turn: the chat route's prompt of the whole conversation (Tokenization.encode_chat),
started, when it goes on from a stored response, with exactly the token ids of that response's prompt and output.

Why: the previous turn's prompt and generated tokens are in the radix cache, but only as those very ids. Rendered
again from text, the reply can tokenize differently from how it was generated (a model may write "hel"+"lo" where
the tokenizer would write "hello"), and the cache would match only up to the first difference. So when the new
prompt's text starts with the previous turn's text (the chat template wrote the earlier turns the same way), the new
prompt is those ids and then the tokens of the rest of the text; then the follow-up costs only its new tokens. When
the template rewrites an earlier turn (Qwen3's drops the thinking of turns before the last user message), the
prompt is the plain encoding, and the cache still serves whatever prefix matches.
"""

from __future__ import annotations

import asyncio

from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.responses_store import StoredResponse
from tokenizer_service.tokenization import Tokenization


async def turn_prompt(
    tokenization: Tokenization, chat: ChatCompletionRequest, previous: StoredResponse | None
) -> list[int]:
    ids = await tokenization.encode_chat(chat)
    if previous is None:
        return ids
    prompt_ids, output_ids = previous.token_ids()
    before = prompt_ids + output_ids
    if ids[: len(before)] == before:
        return ids
    # Decoded in the tokenizer pool, as every other text of a request: off the event loop.
    text, before_text = await asyncio.gather(tokenization.decode(ids), tokenization.decode(before))
    if not text.startswith(before_text):
        return ids
    rest = text[len(before_text) :]
    return before + (await tokenization.encode_text(rest, add_special_tokens=False, param="input") if rest else [])
