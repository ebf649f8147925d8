"""The API's front door: what every request passes before any handler reads it.

An ASGI middleware, so that it runs before FastAPI parses a body:

- the bearer token is checked first (writes always need it; reads need it from other hosts than
  loopback, everywhere with `--lock-reads`, and from loopback clients that name the server by a
  host that is not a loopback name, so that a web page re-pointing its own domain at 127.0.0.1
  (DNS rebinding) cannot read the API through a browser on this machine);
- a body is read whole, at most `MAX_BODY` bytes (413 beyond), before the application sees it;
- a JSON body must be strict JSON: no NaN or Infinity (Python's json accepts them, no other JSON
  parser does, and no response could carry them back), nested at most `MAX_DEPTH` deep.

Refusals are JSON in the API's error shape.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

__all__ = ["MAX_BODY", "MAX_DEPTH", "Guard", "loopback_host", "strict_json"]

MAX_BODY: Final = 1 << 20
"""Largest request body, in bytes (a job with its fault plan is a few kilobytes)."""
MAX_DEPTH: Final = 64
"""Deepest nesting of a JSON body (a job spec is 4 levels deep)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_LOOPBACK_NAMES: Final = ("localhost", "localhost.", "ip6-localhost")
Refusal = tuple[Any, ...]
"""(status, error code, message[, problems]) for `_refuse`."""


class BadJSON(ValueError):
    """The body is not strict JSON: `problems` are (key, what was found) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in problems))
        self.problems = problems


def strict_json(data: bytes) -> Any:
    """Parse `data` as strict JSON (RFC 8259); BadJSON names every NaN or Infinity and the first
    place nested too deep, by key, or says why the text is not JSON at all."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise BadJSON([("body", f"nested deeper than {MAX_DEPTH} levels")]) from None
    except UnicodeDecodeError as error:
        raise BadJSON([("body", f"not UTF-8 at byte {error.start}")]) from None
    except json.JSONDecodeError as error:
        raise BadJSON(
            [("body", f"{error.msg} at line {error.lineno}, column {error.colno}")]
        ) from None
    problems = _not_strict(value)
    if problems:
        raise BadJSON(problems)
    return value


def _not_strict(value: Any) -> list[tuple[str, str]]:
    """(key, problem) for each non-finite number, and for the first place deeper than allowed."""
    problems: list[tuple[str, str]] = []
    too_deep = False
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack and len(problems) < 20:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            problems.append(
                (_key(path), f"{item!r} is not a JSON number (NaN and Infinity are not JSON)")
            )
        elif isinstance(item, dict | list):
            if len(path) >= MAX_DEPTH:
                if not too_deep:
                    too_deep = True
                    problems.append((_key(path), f"nested deeper than {MAX_DEPTH} levels"))
                continue
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((v, (*path, str(k))) for k, v in pairs)
    return problems


def _key(path: tuple[str, ...]) -> str:
    shown = ".".join(path[:8]) + (f"... ({len(path)} levels)" if len(path) > 8 else "")
    return shown or "body"


def loopback_host(host_header: str) -> bool:
    """The Host header names this machine by a loopback name or address."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    """See the module docstring. `protected` says which paths need the checks at all."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        lock_reads: bool,
        protected: Callable[[str], bool],
        token_file: str,
    ) -> None:
        self.app = app
        self.token = token.encode()
        self.lock_reads = lock_reads
        self.protected = protected
        self.token_file = token_file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._access(scope, headers)
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body, refusal = await self._read_body(receive, headers)
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    def _access(self, scope: Scope, headers: dict[str, str]) -> Refusal | None:
        given = headers.get("authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            credential.strip().encode(), self.token
        ):
            return None
        where = f"send `Authorization: Bearer <token>` with the token in {self.token_file}"
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            return 401, "RL.0401", f"this request changes state: {where}"
        if self.lock_reads:
            return 401, "RL.0401", f"reads are locked on this server: {where}"
        client = scope.get("client") or ("", 0)
        try:
            from_loopback = ipaddress.ip_address(client[0]).is_loopback
        except ValueError:
            from_loopback = False
        if not from_loopback:
            return 401, "RL.0401", f"reads from other hosts than this one need the token: {where}"
        if not loopback_host(headers.get("host", "")):
            return (
                401,
                "RL.0401",
                "reads without the token are served to this machine only when it is named by a "
                f"loopback host (127.0.0.1, localhost, [::1]), not {headers.get('host', '')!r}: "
                + where,
            )
        return None

    async def _read_body(
        self, receive: Receive, headers: dict[str, str]
    ) -> tuple[bytes, Refusal | None]:
        too_big: Refusal = (413, "RL.0413", f"the request body is larger than {MAX_BODY} bytes")
        declared = headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY:
            return b"", too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and _is_json(headers.get("content-type")):
            try:
                strict_json(body)
            except BadJSON as error:
                return b"", (400, "RL.0400", "the request body is not strict JSON", error.problems)
        return body, None


def _is_json(content_type: str | None) -> bool:
    """FastAPI reads a body as JSON without a content type, or with a JSON one."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def _replay(body: bytes, then: Receive) -> Receive:
    """The body read already, once; after it, the client's own messages (its disconnect)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


async def _refuse(
    send: Send, status: int, code: str, message: str, problems: list[tuple[str, str]] | None = None
) -> None:
    listed = [
        {"key": key, "value": None, "allowed": "strict JSON", "message": f"{key}: {found}"}
        for key, found in problems or []
    ]
    body = json.dumps({"error_code": code, "error_msg": message, "problems": listed}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
