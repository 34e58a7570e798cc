"""What every request to `kvforge serve` passes before its route (kvforge/serve/app.py): the ASGI guard
(body size, Host, Content-Type, API key), the OpenAI-shaped error and the handlers that answer every failure in
its shape (answer_errors_as_json), the decoding of a body (JSON, an object, valid Unicode text) and the limits of the
loaded export. The parameters themselves are
validated once, by the pydantic models of kvforge/serve/protocol.py."""

import contextlib
import hmac
import ipaddress
import json
import re
import socket
from collections.abc import Callable, Iterable
from typing import Any

from kvforge.core.errors import InputError


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        # A lone surrogate echoed from the request would make the JSON response itself fail to encode.
        message = _printable(message)
        param = _printable(param) if param is not None else None
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


DEFAULT_MAX_BODY_BYTES = 2 << 20  # a 2 MiB JSON body holds far more text than any context window
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DRAIN_BYTES = 16 << 20  # an oversize body up to this size is read (and dropped) before the 413


class LongInteger:
    """A JSON integer with more digits than Python converts (sys.get_int_max_str_digits()), kept as its digit
    count so that check_unicode's walk can name its field: json.loads alone says only "use
    sys.set_int_max_str_digits()", advice for the server's own code, not for its client."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _integer(text: str) -> int | LongInteger:
    try:
        return int(text)
    except ValueError:  # over the conversion limit: its digits are all it has (JSON has checked the syntax)
        return LongInteger(text)


def decode_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of Unicode text, or a 400 saying why. Run before FastAPI reads the
    body (off the event loop: a 2 MiB body takes tens of ms), with this server's words for JSON that
    is nested too deeply, malformed or not an object, for an integer too long to convert, and for lone
    surrogates, which pydantic cannot name the place of."""
    try:
        try:
            body = json.loads(raw)
        except ValueError as err:
            if "integer string conversion" not in str(err):
                raise
            # Parsed again (only then: a Python parse_int is slower), keeping each long integer for the walk to name.
            body = json.loads(raw, parse_int=_integer)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse; send a flatter JSON object") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_unicode(body)
    return body


def within(name: str, value: int, low: int, high: int) -> int:
    """`value` of parameter `name`, or a 400 when it is outside [low, high]: for the bounds pydantic
    cannot know, those of the loaded export (max_tokens and the context)."""
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value!r}", param=name)
    return value


def _valid_text(text: str, where: str, param: str) -> str:
    """`text`, or a 400 for a lone surrogate (JSON's "\\udce9" escape alone), which is not Unicode text
    and which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{where} holds {text[err.start:err.end]!r} at character {err.start}, a lone surrogate, "
                            "which is not Unicode text; send valid UTF-8 (a \\ud800-\\udbff escape must be followed "
                            "by a \\udc00-\\udfff one)", param=param) from None
    return text


def check_unicode(body: Any) -> None:
    """A 400 naming the first key or string of a parsed body that holds a lone surrogate: JSON lets
    "\\ud800" stand alone, but it is not Unicode text, and a grammar, a key echoed in an error or the
    tokenizer would fail on it later with a 500; and one naming an integer too long (LongInteger).
    Walked without recursion (a body may nest deeply)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        param = where.split(".")[0].split("[")[0] or None
        if isinstance(value, LongInteger):
            raise ApiError(400, f"'{where}' is an integer too long ({value.digits} digits); no parameter takes a "
                                "number that large", param=param)
        if isinstance(value, str):
            _valid_text(value, f"'{where}'" if where else "the body", param)
        elif isinstance(value, dict):
            for key, item in value.items():
                _valid_text(key, f"a key of '{where}'" if where else "a key of the body", param)
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))


class Guard:
    """ASGI middleware run before FastAPI sees a request: Host check (DNS rebinding), API key
    (constant-time), and for POSTs the content type and a body read up to `max_body_bytes` (413
    beyond it, before the rest arrives). `on_refuse(path, status, message)` hears of each refusal
    (the request log)."""

    OPEN_PATHS = ("/health", "/metrics")  # answered without the key (probes, scrapers)

    def __init__(self, app: Any, api_key: str | None, allowed_hosts: frozenset[str] | None, max_body_bytes: int,
                 on_refuse: Callable[[str, int, str], None] | None = None,
                 form_paths: frozenset[str] = frozenset()) -> None:
        """`form_paths`: the POST paths that take `multipart/form-data` (file uploads) instead of JSON."""
        self.app = app
        self.form_paths = form_paths
        self.on_refuse = on_refuse
        self.expected = api_key.encode() if api_key is not None else None
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes

    def _host_ok(self, name: str) -> bool:
        assert self.allowed_hosts is not None
        if "*" in self.allowed_hosts or name in self.allowed_hosts:
            return True
        if "*ip" in self.allowed_hosts:  # bound to a wildcard address: any IP literal (not a rebindable name)
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(name)
                return True
        return False

    def _wrong_type(self, path: str, headers: dict[str, bytes]) -> ApiError | None:
        """A POST's content type where it is not the path's: JSON, or a file upload on `form_paths`."""
        ctype = headers.get("content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        shown = ctype or "no content type"
        if path in self.form_paths:
            return None if ctype == "multipart/form-data" else ApiError(
                415, f"send the file as 'multipart/form-data' (got {shown!r})", code="unsupported_media_type")
        return None if ctype == "application/json" else ApiError(
            415, f"send the body as JSON with 'Content-Type: application/json' (got {shown!r})",
            code="unsupported_media_type")

    @staticmethod
    async def _drain(receive: Callable, size: int) -> bool:
        """Read and drop the rest of an oversize body (up to DRAIN_BYTES, for at most 5 s), so that
        the 413 reaches the client: closing a socket with unread data resets the connection and the
        client may see that instead. False if the client went away."""
        import anyio

        with anyio.move_on_after(5):
            while size <= DRAIN_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        return True

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse

        headers = {k.decode("latin-1"): v for k, v in scope.get("headers", [])}

        async def refuse(err: ApiError) -> None:
            if self.on_refuse is not None:
                self.on_refuse(scope["path"], err.status, err.message)
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)

        repeated = _repeated(scope.get("headers", []))
        if repeated is not None:  # which one counts would be a guess (a proxy may take the first, this dict the last)
            return await refuse(ApiError(400, f"the request has more than one {repeated} header; send exactly one",
                                         code="repeated_header"))
        host = headers.get("host")
        name = host_name(host.decode("latin-1")) if host is not None else None
        if host is not None and name is None:
            return await refuse(ApiError(400, f"the Host header {host.decode('latin-1')[:100]!r} is malformed; send "
                                              "a name or address and an optional port (e.g. 127.0.0.1:8000)",
                                         code="bad_host"))
        if self.allowed_hosts is not None and name is not None and not self._host_ok(name):
            shown = host.decode("latin-1")[:100]
            return await refuse(ApiError(
                421, f"this server does not answer for Host {shown!r} (a page on another site may be trying to "
                     f"reach it); use http://127.0.0.1, or, if that name is yours, start the server with "
                     f"--allow-host {shown.split(':')[0]}",
                code="host_not_allowed"))
        if self.expected is not None and scope["path"] not in self.OPEN_PATHS:
            # RFC 7235: the scheme is case-insensitive ("bearer KEY" is as good as "Bearer KEY").
            scheme, _, token = headers.get("authorization", b"").partition(b" ")
            key_ok = hmac.compare_digest(token.strip(), self.expected)  # compared whatever the scheme: constant time
            if scheme.lower() != b"bearer" or not key_ok:
                return await refuse(ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                             kind="authentication_error", code="invalid_api_key"))
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        wrong_type = self._wrong_type(scope["path"], headers)
        if wrong_type is not None:
            return await refuse(wrong_type)
        too_big = ApiError(413, f"the request body is over this server's limit of {self.max_body_bytes} bytes "
                                "(kvforge serve --max-body-bytes); send a shorter prompt", code="request_too_large")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await refuse(ApiError(400, "the Content-Length header is not a number"))
            if int(length) > self.max_body_bytes:
                if int(length) <= DRAIN_BYTES and not await self._drain(receive, 0):
                    return None
                return await refuse(too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body", False) and not await self._drain(receive, size):
                    return None
                return await refuse(too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:  # the body once, then the client's own messages (disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


SINGLE_HEADERS = ("authorization", "host", "content-type", "content-length")  # the guard reads one of each


def _repeated(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The first header of SINGLE_HEADERS that the request sends more than once (ASGI names are lowercase)."""
    names = [name.decode("latin-1").lower() for name, _ in headers]
    return next((name.title() for name in SINGLE_HEADERS if names.count(name) > 1), None)


# RFC 9110's Host: a name or IPv4 address, or an IPv6 address in brackets, then an optional port.
# Anything else ("127.0.0.1:80@evil.example", "a b", "host:port:x") is a malformed request (RFC 9112: 400).
HOST_HEADER = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?")


def host_name(value: str) -> str | None:
    """The name a Host header names (lowercase, brackets and a trailing dot dropped), or None when it
    is malformed."""
    match = HOST_HEADER.fullmatch(value)
    if match is None or (match["port"] is not None and int(match["port"]) > 65535):
        return None
    name = match["name"].lower()
    if name.startswith("["):
        try:
            return str(ipaddress.IPv6Address(name[1:-1]))
        except ValueError:
            return None
    return name.rstrip(".")


def check_api_key(api_key: str | None) -> None:
    """Refuse a key no client could ever send (every request would then be a 401)."""
    if api_key is None:
        return
    if api_key == "" or api_key != api_key.strip():
        raise InputError("--api-key is empty or has spaces around it, so no 'Authorization: Bearer KEY' header "
                         "could match it; pass the key without surrounding whitespace")
    if not (api_key.isascii() and api_key.isprintable()):
        raise InputError("--api-key must be printable ASCII (HTTP headers carry no other text), so this one could "
                         "never match; choose another key")


def allowed_hosts_for(host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names a server bound to `host` answers: loopback names, the bound address, and
    `extra` (`--allow-host`; `*` allows all); bound to a wildcard address, also any IP literal and
    this machine's names."""
    names = {*LOOPBACK_HOSTS, host.strip("[]").lower(), *(h.strip().lower().rstrip(".") for h in extra)}
    if host in ("0.0.0.0", "::", ""):
        names |= {"*ip", socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(names)


def answer_errors_as_json(app: Any) -> None:
    """Every error in OpenAI's JSON shape: ours (ApiError), routing's (404 / 405), and a bug's (500)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        rid = getattr(request.state, "request_id", None)  # the log line's id, for a body that carries none
        return JSONResponse(err.body(), status_code=err.status, headers={"x-request-id": rid} if rid else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError):  # a route's own are api_error's
        first = err.errors()[0] if err.errors() else {}
        param = next((str(p) for p in first.get("loc", ()) if p != "body"), None)
        error = ApiError(400, f"{param or 'the request'}: {first.get('msg', 'invalid')}", param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(err.status_code, str(err.detail), kind=kind).body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception):  # a bug: still JSON, never a plain-text page
        message = f"internal error: {type(err).__name__}: {err}"[:500]
        return JSONResponse(ApiError(500, message, kind="server_error").body(), status_code=500)
