"""Host, Origin and Content-Type checks: a pure-ASGI guard against DNS rebinding and
cross-site requests from a browser on the user's machine.

Rules, checked in this order on every HTTP request (``/health`` included; the API key is a
separate check made by the routes):

1. **Host.** The ``Host`` header must name an allowed host, else 403 ``forbidden_host``.
   Allowed: ``localhost``, ``127.0.0.1`` and ``[::1]``; the bind address itself; every name
   in ``[server].allowed_hosts`` (``*`` allows any Host, for a reverse proxy that checks it);
   and, on a wildcard bind (``0.0.0.0`` or ``::``), any IP literal. The port is *not*
   compared: it is whatever the client dialled (ssh ``-L``, ``docker -p``), and DNS
   rebinding is stopped by the name, which is the attacker's own domain, never an IP
   literal or one of ours.
2. **Origin.** When an ``Origin`` header is present it must be same-origin with the request
   (scheme ``http`` or ``https``, the Host's host and port; a missing port is the scheme's
   default) or be listed in ``[server].allowed_origins``, else 403 ``forbidden_origin``.
   ``Origin: null`` (sandboxed frames, ``file:``) is refused. A page of another local origin
   (``http://localhost:3000``) is therefore refused too.
3. **Content-Type.** A POST, PUT, PATCH or DELETE that carries a body (a non-zero
   ``Content-Length`` or any ``Transfer-Encoding``) must say ``Content-Type:
   application/json``, else 415 ``unsupported_media_type``. A browser sends ``text/plain``,
   a form type or no type at all without a CORS preflight; JSON always needs one. A DELETE
   without a body needs no type (rule 2 still applies to it). The audio routes
   (``/v1/audio/...``) take OpenAI's ``multipart/form-data`` instead: a browser sends that
   cross-site without a preflight, but always with an ``Origin`` header, so rule 2 (and the
   API key, when one is set) guards them.

4. **CORS.** A request whose ``Origin`` is listed in ``[server].allowed_origins`` (a web UI
   served from elsewhere) gets what a browser needs to let that page read the answer: a
   preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered 204 with the
   methods and the headers it asked for (the origin is the operator's choice: its page may
   send the API key, an Idempotency-Key, an SDK's own headers); every answer carries
   ``Access-Control-Allow-Origin`` and exposes the ``X-Spillover-*`` and retry headers. No
   other origin gets any ``Access-Control-*`` header: a browser keeps such answers from its
   page, and rule 2 refuses its requests anyway. No cookies are involved (no credentials).

``HostPolicy.refusal`` decides (no I/O, table-tested); ``OriginGuard`` acts on it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spillover.config import ServerConfig
from spillover.errors import Forbidden, SpilloverError, UnsupportedMediaType

__all__ = ["HostPolicy", "OriginGuard", "parse_origin"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_NAME_RE = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _show(value: str) -> str:
    """A header value quoted for an error message, cut short."""
    return repr(value[:100])


def split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` or ``[v6]:port`` as (lower-case host without brackets, port); None
    when malformed. One trailing dot is dropped (``localhost.`` is ``localhost``)."""
    value = value.strip().lower()
    port_text = ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                return None
            port_text = rest[1:]
        try:
            if ipaddress.ip_address(host).version != 6:
                return None
        except ValueError:
            return None
    else:
        host, colon, port_text = value.partition(":")
        if colon and not port_text:
            return None
        host = host.removesuffix(".")
        if not _NAME_RE.match(host):
            return None
    if port_text and not (port_text.isdigit() and len(port_text) <= 5 and int(port_text) <= 65535):
        return None
    return host, int(port_text) if port_text else None


def parse_origin(value: str) -> tuple[str, str, int] | None:
    """``scheme://host[:port]`` as (scheme, host, port with the scheme's default); None when
    it is not an http(s) origin (``null``, a path, user info, another scheme)."""
    scheme, sep, rest = value.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS or any(c in rest for c in "/?#@\\"):
        return None
    hp = split_host(rest)
    if hp is None:
        return None
    host, port = hp
    return scheme, host, _DEFAULT_PORTS[scheme] if port is None else port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


FORM_PATHS = ("/v1/audio/",)  # rule 3: routes whose body is multipart/form-data
CORS_METHODS = b"GET, POST, DELETE, OPTIONS"  # rule 4: every method a route answers
CORS_EXPOSED = (  # rule 4: the answer's headers a page may read
    b"X-Spillover-Request-Id, X-Spillover-Route, X-Spillover-Degraded, X-Spillover-Reason, X-Spillover-Model, "
    b"X-Spillover-Limits, X-Spillover-Queue-Position, X-Spillover-Estimated-Delay-Ms, X-Spillover-Attempts, "
    b"Retry-After, retry-after-ms, x-should-retry, Idempotent-Replayed"
)
CORS_MAX_AGE_S = b"600"


@dataclass(frozen=True)
class HostPolicy:
    """Which Hosts and Origins a gateway answers (see the module's rules)."""

    hosts: frozenset[str]
    any_host: bool = False
    any_ip_literal: bool = False
    origins: frozenset[tuple[str, str, int]] = frozenset()

    @classmethod
    def from_config(cls, server: ServerConfig) -> HostPolicy:
        """The policy of ``[server]``: loopback names, the bind address and the allow lists."""
        bind = server.host.strip().lower().strip("[]")
        names = {h.strip().lower().strip("[]").removesuffix(".") for h in server.allowed_hosts}
        origins = {o for o in map(parse_origin, server.allowed_origins) if o is not None}
        return cls(
            hosts=frozenset((LOOPBACK_NAMES | names | {bind}) - WILDCARD_BINDS - {"*"}),
            any_host="*" in names,
            any_ip_literal=bind in WILDCARD_BINDS,
            origins=frozenset(origins),
        )

    def cors_origin(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Rule 4: the request's one ``Origin`` when ``allowed_origins`` lists it, else None."""
        if not self.origins:  # the usual case: no header scan on every request
            return None
        values = [v for n, v in headers if n.lower() == b"origin"]
        if len(values) != 1:
            return None
        return values[0] if parse_origin(values[0].decode("latin-1")) in self.origins else None

    def host_allowed(self, host: str) -> bool:
        """Rule 1 for a parsed host name (no port)."""
        return self.any_host or host in self.hosts or (self.any_ip_literal and _is_ip(host))

    def refusal(self, method: str, headers: list[tuple[bytes, bytes]], path: str = "") -> SpilloverError | None:
        """The error that refuses this request, or None to let it through."""
        seen: dict[bytes, list[str]] = {b"host": [], b"origin": [], b"content-type": []}
        has_body = False
        for raw_name, raw_value in headers:
            name = raw_name.lower()
            if name in seen:
                seen[name].append(raw_value.decode("latin-1"))
            elif name == b"content-length":
                has_body = has_body or raw_value.strip() != b"0"
            elif name == b"transfer-encoding":
                has_body = True
        hosts, origins, types = seen[b"host"], seen[b"origin"], seen[b"content-type"]
        parsed = split_host(hosts[0]) if len(hosts) == 1 else None
        if parsed is None:
            return Forbidden("exactly one well-formed Host header is required", code="forbidden_host")
        host, port = parsed
        if not self.host_allowed(host):
            return Forbidden(
                f"Host {_show(hosts[0])} is not served here (DNS rebinding guard); "
                "add the name to [server].allowed_hosts",
                code="forbidden_host",
            )
        if origins:
            origin = parse_origin(origins[0]) if len(origins) == 1 else None
            same = origin is not None and (origin[1], origin[2]) == (
                host,
                _DEFAULT_PORTS[origin[0]] if port is None else port,
            )
            if not same and origin not in self.origins:
                return Forbidden(
                    f"Origin {_show(origins[0])} may not call this gateway (cross-site request); "
                    "add it to [server].allowed_origins",
                    code="forbidden_origin",
                )
        if method.upper() in BODY_METHODS and has_body:
            media, _, params = types[0].partition(";") if len(types) == 1 else ("", "", "")
            wanted = "multipart/form-data" if path.startswith(FORM_PATHS) else "application/json"
            got = _show(types[0]) if len(types) == 1 else f"{len(types)} Content-Type headers" if types else "none"
            if media.strip().lower() != wanted:
                return UnsupportedMediaType(
                    f"a request body must be sent with 'Content-Type: {wanted}' (got {got})",
                    param="Content-Type",
                )
            if _charset(params) not in (None, "utf-8", "utf8", "us-ascii"):  # JSON is UTF-8 (RFC 8259)
                return UnsupportedMediaType(
                    f"a request body must be UTF-8, as JSON is (got {got})",
                    param="Content-Type",
                )
        return None


def _charset(params: str) -> str | None:
    """A media type's ``charset`` parameter, lower-case and unquoted; None when it has none."""
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


class OriginGuard:
    """ASGI middleware: answers a request that ``policy`` refuses with ``refuse(error, path)``
    (the path picks the answer's shape: Ollama's under ``/api/``), and tells ``on_refused`` of
    each of its own refusals (the gateway counts them as refusals before acceptance)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        policy: HostPolicy,
        refuse: Callable[[BaseException, str], Response],
        on_refused: Callable[[SpilloverError], None] = lambda _error: None,
    ) -> None:
        self.app = app
        self.policy = policy
        self.refuse = refuse
        self.on_refused = on_refused

    def __repr__(self) -> str:
        return f"<OriginGuard hosts={sorted(self.policy.hosts)} any_host={self.policy.any_host}>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        error = self.policy.refusal(scope.get("method", "GET"), scope["headers"], scope.get("path", ""))
        if error is not None:
            self.on_refused(error)
        origin = self.policy.cors_origin(scope["headers"]) if scope["type"] == "http" else None
        if origin is not None:  # rule 4: whatever the answer, its page may read it
            await self._cors(origin, error, scope, receive, send)
        elif error is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await self.refuse(error, scope.get("path", ""))(scope, receive, send)

    async def _cors(
        self, origin: bytes, error: SpilloverError | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Rule 4 for a listed origin: its preflight answered here; its answers (a refusal of
        rule 1 or 3, an error the app did not answer) marked."""
        headers = dict((n.lower(), v) for n, v in scope["headers"])
        allow = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if error is None and scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", b"")
            preflight = [
                *allow,
                (b"access-control-allow-methods", CORS_METHODS),
                (b"access-control-max-age", CORS_MAX_AGE_S),
                *([(b"access-control-allow-headers", asked)] if asked else []),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": preflight})
            await send({"type": "http.response.body", "body": b""})
            return
        started = False

        async def marked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {
                    **message,
                    "headers": [*message.get("headers", []), *allow, (b"access-control-expose-headers", CORS_EXPOSED)],
                }
            await send(message)

        if error is not None:
            await self.refuse(error, scope.get("path", ""))(scope, receive, marked)
            return
        try:
            await self.app(scope, receive, marked)
        except Exception as exc:  # the server's 500 is answered outside this guard, unmarked
            if not started:
                await self.refuse(exc, scope.get("path", ""))(scope, receive, marked)
            raise  # logged as before; the answer is sent
