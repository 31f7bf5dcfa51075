"""Python client for a radixserve server: the OpenAI routes, the native /generate route and the admin routes, over
httpx, with typed results, streaming iterators and errors that carry the server's message.

```python
from radixserve.client import Client
client = Client("http://127.0.0.1:30000")
reply = client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0)
print(reply.text)
```

`AsyncClient` has the same methods as coroutines; its streaming methods return async iterators.

The package: `sync_client.py` (`Client`), `async_client.py` (`AsyncClient`), `shared.py` (what both build the same
way: address, key, timeouts, each route's path and body), `results.py` (what they return), `errors.py` (what they
raise).

Structured replies and tools: `response_format` ({"type": "json_object"}, or {"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}) on chat and completions, `tools` and `tool_choice` on chat. The functions called
are `reply.tool_calls` (ToolCall: name and parsed JSON arguments; finish_reason "tool_calls"); when streamed, the
chunks' `tool_call_deltas`, put together by `tool_calls_from_deltas`. Example:
`client.chat(messages, tools=[get_weather], tool_choice="required").tool_calls[0].arguments["city"]`.

Streaming (`stream=True`) returns a `Stream` of `StreamChunk`s, each with the new text (`.text`, a delta, never
cumulative). The last chunks carry `finish_reason` and, where the server reports it, `usage`: for the OpenAI routes
the client asks for `stream_options={"include_usage": True}` unless you pass your own `stream_options`. Leaving a
stream early (break, `close()`, the `with` block ending) closes the connection, and the server aborts the request.

Errors:
    RadixServeError            the server answered 4xx/5xx (status_code, message, type, param, code, body), or sent
                               an error inside a stream; base class of the two below
    RadixServeConnectionError  no connection (server down, wrong URL), or it broke mid-response
    RadixServeTimeoutError     no answer within the timeout (connect, or the next bytes of a response)
"""

from radixserve.client.async_client import AsyncClient
from radixserve.client.errors import RadixServeConnectionError, RadixServeError, RadixServeTimeoutError
from radixserve.client.results import (
    AsyncStream,
    ChatResult,
    Choice,
    CompletionResult,
    GenerateResult,
    Model,
    Stream,
    StreamChunk,
    ToolCall,
    Usage,
    tool_calls_from_deltas,
)
from radixserve.client.sync_client import Client

# The public API: both clients and everything they return or raise.
__all__ = [
    "AsyncClient",
    "AsyncStream",
    "ChatResult",
    "Choice",
    "Client",
    "CompletionResult",
    "GenerateResult",
    "Model",
    "RadixServeConnectionError",
    "RadixServeError",
    "RadixServeTimeoutError",
    "Stream",
    "StreamChunk",
    "ToolCall",
    "Usage",
    "tool_calls_from_deltas",
]
