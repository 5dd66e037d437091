"""What every HTTP request passes before the application sees it: the API key, the body size.

Pure ASGI, ahead of FastAPI: the key is checked from the headers before a byte of the body is
read (a client without the key cannot make the server parse anything), and a body over the limit
is refused with 413 while it arrives, never buffered whole.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from specbatch.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # probes answer without a key


class RequestGuard:
    """API-key and body-size checks for an ASGI application."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        open_paths: frozenset[str] = OPEN_PATHS,
        on_reject: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if scope["path"] not in self.open_paths and not self._authorized(headers):
            await self._reject(
                send,
                401,
                "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                "invalid_api_key",
                [(b"www-authenticate", b'Bearer realm="specbatch"')],
            )
            return
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._reject(send, 400, "invalid Content-Length header", None)
                return
            if int(declared) > self.max_body_bytes:
                await self._too_large(send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = headers.get("authorization", b"").partition(b" ")
        # Raw bytes against the key's UTF-8 (a non-ASCII key works as clients send it);
        # compare_digest: the time taken does not reveal how much of the key matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(
            token.strip(), self.api_key.encode("utf-8")
        )

    async def _too_large(self, send: Send) -> None:
        await self._reject(
            send,
            413,
            f"the request body is larger than {self.max_body_bytes} bytes",
            "request_too_large",
        )

    async def _reject(
        self,
        send: Send,
        status: int,
        message: str,
        code: str | None,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        payload = json.dumps(error_body(status, message, None, code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
            *(extra_headers or []),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body over once, then waits on the client (so a
    disconnect is still seen)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
