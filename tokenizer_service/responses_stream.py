"""The server-sent events of a streamed /v1/responses request, in the order OpenAI sends them and the official
`openai` client's ResponseStream checks them:

    response.created, response.in_progress
    per output item, in order (a reasoning item, a message, function calls):
        response.output_item.added
        reasoning:  response.content_part.added, response.reasoning_text.delta ..., response.reasoning_text.done,
                    response.content_part.done
        message:    response.content_part.added, response.output_text.delta ..., response.output_text.done,
                    response.content_part.done
        call:       response.function_call_arguments.delta, response.function_call_arguments.done
        response.output_item.done
    response.completed (or response.incomplete when cut by max_output_tokens), holding the whole response

Every event is `event: <type>` and `data: <json>` with a sequence_number counting from 0; there is no [DONE]. An
error after the stream began (the engine failed the request) is a response.failed event with the error.

The pieces come as the chat route's stream deltas ({"reasoning_content", "content", "tool_calls"}, from
reasoning.ReasoningReply or structured_outputs.ChatTools). Tool-call parsers give each call whole, so a call's item
opens and closes in one step.
"""

from __future__ import annotations

import msgspec

from tokenizer_service.responses_output import function_call_item, message_item, new_id, output_text, reasoning_item

REASONING_PART = {"type": "reasoning_text", "text": ""}


class ResponseEvents:
    """One streamed response's events. `items` holds the output items completed so far, as the final response
    lists them."""

    def __init__(self, response: dict):
        self.response = response  # the response object in progress: status in_progress, no output yet
        self.sequence_number = 0
        self.items: list[dict] = []
        self._open: tuple[str, str, str] | None = None  # the item being written: (type, id, text so far)

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    def start(self) -> list[bytes]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def _where(self, item_id: str) -> dict:
        return {"item_id": item_id, "output_index": len(self.items)}

    def _text_item(self, kind: str, text: str) -> list[bytes]:
        """The `text` delta of the open reasoning or message item, which is opened first if need be."""
        events = []
        if self._open is not None and self._open[0] != kind:
            events += self._close()
        if self._open is None:
            item_id = new_id("rs" if kind == "reasoning" else "msg")
            item = (
                reasoning_item(item_id, "", "in_progress")
                if kind == "reasoning"
                else message_item(item_id, "", "in_progress")
            )
            if kind == "reasoning":
                item["content"] = []
            part = REASONING_PART if kind == "reasoning" else output_text("")
            events += [
                self._event("response.output_item.added", output_index=len(self.items), item=item),
                self._event("response.content_part.added", content_index=0, part=part, **self._where(item_id)),
            ]
            self._open = (kind, item_id, "")
        _, item_id, so_far = self._open
        self._open = (kind, item_id, so_far + text)
        if kind == "reasoning":
            events.append(
                self._event("response.reasoning_text.delta", content_index=0, delta=text, **self._where(item_id))
            )
        else:
            events.append(
                self._event(
                    "response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._where(item_id)
                )
            )
        return events

    def _close(self) -> list[bytes]:
        kind, item_id, text = self._open
        self._open = None
        where = self._where(item_id)
        if kind == "reasoning":
            item = reasoning_item(item_id, text)
            events = [
                self._event("response.reasoning_text.done", content_index=0, text=text, **where),
                self._event("response.content_part.done", content_index=0, part=item["content"][0], **where),
            ]
        else:
            item = message_item(item_id, text)
            events = [
                self._event("response.output_text.done", content_index=0, text=text, logprobs=[], **where),
                self._event("response.content_part.done", content_index=0, part=item["content"][0], **where),
            ]
        events.append(self._event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        return events

    def _call(self, call: dict) -> list[bytes]:
        events = self._close() if self._open is not None else []
        item_id = new_id("fc")
        where = self._where(item_id)
        item = function_call_item(item_id, call)
        events += [
            self._event(
                "response.output_item.added",
                output_index=len(self.items),
                item=function_call_item(item_id, call, "in_progress"),
            ),
            self._event("response.function_call_arguments.delta", delta=item["arguments"], **where),
            self._event("response.function_call_arguments.done", arguments=item["arguments"], **where),
            self._event("response.output_item.done", output_index=len(self.items), item=item),
        ]
        self.items.append(item)
        return events

    def delta(self, delta: dict) -> list[bytes]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text_item("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text_item("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def close(self) -> list[bytes]:
        """Ends the item still open, once the reply has ended."""
        return self._close() if self._open is not None else []

    def complete(self, response: dict) -> list[bytes]:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def failed(self, message: str, status: int) -> list[bytes]:
        code = "server_error" if status >= 500 else "invalid_request"
        response = {
            **self.response,
            "status": "failed",
            "output": self.items,
            "error": {"code": code, "message": message},
        }
        return [self._event("response.failed", response=response)]
