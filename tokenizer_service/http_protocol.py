"""uvicorn's httptools protocol with two changes: a request line + headers over --max-header-bytes gets 431, and
requests the HTTP parser rejects (bad method, bad chunk size, Content-Length together with Transfer-Encoding, ...)
get OpenAI error JSON instead of uvicorn's plain-text 400. Both are answered before the app ever sees a request,
so they cannot be done in ASGI middleware.

What cannot be shaped: a client that closes the connection, or stops sending in the middle of a request head,
gets no response at all (there is nobody to answer, or nothing yet to answer). Everything the parser rejects,
including bytes that are not HTTP at all (such as a TLS handshake), gets the JSON 400.
"""

from __future__ import annotations

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenizer_service.errors import error_json


# What the callbacks do not count of a head: the request line's method and version, and the line ends.
HEAD_FRAMING_BYTES = 64


class _HeadTooLarge(Exception):
    pass


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 64 * 1024  # set per server by protocol_class()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head, self._head_bytes, self._raw_head_bytes, self._head_too_large = False, 0, 0, False

    # Callbacks of the parser: count what the head holds so far.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._raw_head_bytes = True, 0, 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge  # httptools turns it into HttpParserCallbackError

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
            if self._in_head:
                # The parser buffers a header until it is complete: count the raw bytes of a head still arriving
                # too, so that one endless header line is refused before it fills memory. Apart from the callbacks'
                # count, which sees the same bytes again once their header is complete: added to it, a head that
                # arrived in several pieces counted up to twice its size.
                self._raw_head_bytes += len(data)
                if self._raw_head_bytes > self.max_head_bytes + HEAD_FRAMING_BYTES:
                    self._head_too_large = True
                    raise _HeadTooLarge
        except (httptools.HttpParserError, _HeadTooLarge) as e:
            if self._head_too_large:
                self._send_error(
                    431,
                    f"Request header fields too large: the request line and headers may hold at "
                    f"most {self.max_head_bytes} bytes (--max-header-bytes)",
                )
            else:
                self._send_error(400, f"Invalid HTTP request: {e}")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def send_400_response(self, msg: str) -> None:
        self._send_error(400, msg)

    def _send_error(self, status: int, message: str) -> None:
        self.logger.warning("%s: %s", status, message)
        body = error_json(message, status)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: ",
                str(len(body)).encode(),
                b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()


def protocol_class(max_header_bytes: int) -> type[JsonErrorHttpToolsProtocol]:
    return type("JsonErrorHttpToolsProtocol", (JsonErrorHttpToolsProtocol,), {"max_head_bytes": max_header_bytes})
