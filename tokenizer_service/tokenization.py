"""Prompts to token ids, off the HTTP event loop.

Tokenizing a long prompt or rendering a chat template takes CPU time proportional to the text (seconds for a few
MB). On the event loop that time would stall /health and every other client, so it runs in a thread pool
(--tokenizer-workers, by default one thread per CPU this process may use). The encoding itself goes through the Rust
tokenizer's `encode_batch`, which releases the GIL while it runs (its single-text `encode` does not), so threads
encode on as many cores as there are; a list of prompts is one batch, spread over cores by the tokenizer itself.

Chat prompts: the template is rendered whole (Jinja, ~50 us), then tokenized piece by piece between the special
tokens that the template writes around each message, each piece's ids cached by its text (chat_segments.py), so a
repeated system prompt or an earlier turn costs a hash lookup instead of an encode. A start-up check on sample
conversations (segment_check.py) turns that off, with a warning in the log, for a tokenizer or template where the
pieces' ids could differ from the whole prompt's; so does --disable-chat-segment-cache.

The pool threads share one private copy of the tokenizer, used only through calls that do not change it (rendering,
`encode_batch`, decoding): the HF wrapper's own encode may reset the Rust tokenizer's truncation and padding, which
is not safe while another thread encodes, and the event loop keeps using the server's copy. A tokenizer without a
Rust backend (a sentencepiece-only model) keeps a copy per thread, as its Python encode holds the GIL anyway.

A chat prompt whose pieces are cached but for a few short new ones (a question under a long, known system prompt) is
tokenized on the event loop itself (--inline-tokenize-chars): the render (~45 us for an 8K-character prompt) and the
lookups (~10 us) cost less than the trip to a pool thread and back, which under load also waits for the GIL behind
the streams being written. Measured on an H100 host, issue 27's burst of 128 chat requests over 8 cached system
prompts: time to first token p50 186 ms against 207 ms with every prompt in the pool (paired bursts,
bench/results/ttft-under-load-h100.md). A prompt over INLINE_RENDER_MAX_CHARS, or with more new text than the flag
allows, still goes to the pool.

Before any of that, a cheap length check: no token of this vocabulary spans more than `max_token_chars`
characters, so a text longer than context_len * max_token_chars can never fit the context and is refused at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tokenizer_service.chat_segments import SegmentEncoder, segment_problem
from tokenizer_service.errors import RequestError
from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.segment_cache import SegmentCache
from tokenizer_service.segment_check import check_segments
from tokenizer_service.structured_outputs import chat_template_inputs

logger = logging.getLogger(__name__)

# Rendering a chat template on the event loop is bounded by the conversation's size: ~50 us for 8K characters, so a
# 64K-character conversation stays well under a millisecond; anything longer renders in the pool.
INLINE_RENDER_MAX_CHARS = 65536


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry (added tokens such as <|im_start|> included). Byte-level entries
    have one character per byte, so this bounds how many characters of text one token can cover."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


class Tokenization:
    """Encodes prompts and renders chat templates in a thread pool, after the cheap length check. The ids are
    validated afterwards with the sampling parameters (serving.build_prompts). segment_cache_mib 0: chat prompts
    are tokenized whole."""

    def __init__(self, tokenizer, context_len: int, workers: int, segment_cache_mib: int = 0, inline_chars: int = 0):
        self.tokenizer, self.context_len = tokenizer, context_len
        self.inline_chars = inline_chars  # new (uncached) characters a chat prompt may have to stay on the loop
        self.max_token_chars = longest_token_chars(tokenizer)
        self._local = threading.local()
        self._shared = copy.deepcopy(tokenizer)  # the pool's own: nothing on the event loop touches it
        self._backend = getattr(self._shared, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if self._backend is not None:  # as the HF wrapper sets it before each of its own encodes
            self._backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self.segments, self.whole_prompt_reason = self._segment_encoder(segment_cache_mib)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        if self._backend is None:
            for _ in range(workers):  # copy the tokenizer now rather than in the first requests
                self._pool.submit(self._thread_tokenizer)

    def _segment_encoder(self, cache_mib: int) -> tuple[SegmentEncoder | None, str | None]:
        """The piece-wise chat encoder, or (None, why chat prompts are tokenized whole)."""
        if cache_mib <= 0:
            return None, "turned off (--disable-chat-segment-cache)"
        if not getattr(self.tokenizer, "chat_template", None):
            return None, "the model has no chat template"
        reason = segment_problem(self._shared) or check_segments(self._shared, self._backend)
        if reason is not None:
            logger.warning("Chat prompts are tokenized whole, not per message: %s", reason)
            return None, reason
        ints = tuple(range(self._backend.get_vocab_size(with_added_tokens=True)))
        logger.info("Chat prompts are tokenized per message, up to %d MiB of pieces cached", cache_mib)
        return SegmentEncoder(self._backend, SegmentCache(cache_mib << 20, ints)), None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ threads

    def _thread_tokenizer(self):
        """The tokenizer this pool thread may use: the shared copy, or with no Rust backend a copy of its own."""
        if self._backend is not None:
            return self._shared
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    async def _run(self, fn: Callable[..., Any], *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------------------------------- checks

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.context_len * self.max_token_chars:
            raise RequestError(
                f"This model's maximum context length is {self.context_len} tokens. However, your {param} has "
                f"{chars} characters, more than {self.context_len} tokens can hold (no token of this model spans "
                f"more than {self.max_token_chars} characters). Please reduce the length of the {param}.",
                param=param,
            )

    # ------------------------------------------------------------------------------------------ prompts

    def _encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if self._backend is not None:  # one batch: the GIL released, the texts spread over cores
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        tokenizer = self._thread_tokenizer()
        return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    async def encode_prompts(self, prompt: str | list, param: str) -> list[list[int]]:
        """The OpenAI prompt shapes (str, list[str], list[int], list[list[int]]) as token-id lists."""
        if isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            for text in texts:
                self.check_chars(len(text), param)
            prompts = await self._run(self._encode_texts, texts)
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        return prompts

    async def encode_text(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """One text as token ids (/v1/tokenize), special tokens (BOS) only when asked for."""
        self.check_chars(len(text), param)
        return (await self._run(self._encode_texts, [text], add_special_tokens))[0]

    def _decode(self, ids: list[int]) -> str:
        return self._thread_tokenizer().decode(ids)

    async def decode(self, ids: list[int]) -> str:
        """Token ids as text (/v1/detokenize), special tokens included, as vLLM decodes them."""
        return await self._run(self._decode, ids)

    def _apply_template(self, tokenizer, messages: list[dict], add_generation_prompt: bool, options: dict, **how):
        """The chat template over messages (text, or with tokenize=True in `how` ids); its errors are the request's."""
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **how, **options
            )
        except Exception as e:  # noqa: BLE001 - jinja raises whatever the template says ("roles must alternate")
            raise RequestError(f"Could not apply the chat template: {e}", param="messages") from None

    def _render_chat(
        self, messages: list[dict], add_generation_prompt: bool, options: dict, namespace: str | None = None
    ) -> list[int]:
        tokenizer = self._thread_tokenizer()
        if self._backend is None:
            how = dict(tokenize=True, return_dict=False)
            return list(self._apply_template(tokenizer, messages, add_generation_prompt, options, **how))
        # What apply_chat_template(tokenize=True) does, without the HF wrapper's encode (see the module doc).
        text = self._apply_template(tokenizer, messages, add_generation_prompt, options, tokenize=False)
        if self.segments is not None:
            return self.segments.encode(text, namespace)
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    async def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        """The server's own chat template over the request's messages. chat_template_kwargs reach the template only
        as the allow-listed booleans openai_schema accepts: a client can never supply template source. Pieces are
        cached in the namespace of the request's cache_salt (segment_cache.py says why)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions", param="messages")
        # Tools go to a template that knows them as tools=, else into the system message (structured_outputs.py).
        messages, tool_options = chat_template_inputs(req.template_messages(), req.tools, self.tokenizer)
        chars = sum(len(m["content"]) + len(m.get("name") or "") for m in messages)
        self.check_chars(chars, "messages")
        options = {**dict(req.chat_template_kwargs or {}), **tool_options}
        add_generation_prompt = options.pop("add_generation_prompt", req.add_generation_prompt)
        if req.continue_final_message:
            if add_generation_prompt:  # a new turn's header after an open final message: no template means that
                raise RequestError(
                    "continue_final_message needs add_generation_prompt to be false", param="continue_final_message"
                )
            options["continue_final_message"] = True
        namespace = getattr(req, "cache_salt", None)
        if self.segments is not None and self.inline_chars > 0 and chars <= INLINE_RENDER_MAX_CHARS:
            # On the loop (the module doc says why), with the loop's own tokenizer copy for the render.
            text = self._apply_template(self.tokenizer, messages, add_generation_prompt, options, tokenize=False)
            ids = self.segments.encode_known(text, namespace, self.inline_chars)
            if ids is not None:
                return ids
            return await self._run(self.segments.encode, text, namespace)
        return await self._run(self._render_chat, messages, add_generation_prompt, options, namespace)
