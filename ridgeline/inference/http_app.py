"""HTTP serving for `ridgeline serve` and a training run's endpoint: FastAPI routes on uvicorn (the
stack of vLLM's and SGLang's servers), on a socket bound when the server is built.

Every request passes one gate, in this order, before its body is read:
  1. the route (404 / 405 otherwise);
  2. the key: with an API key, every route but /health needs `Authorization: Bearer <key>` or
     `X-API-Key: <key>` (the Tinker SDK's header; 401);
  3. the load: past `max_requests` requests in progress, 503 (idle and half-sent connections
     do not count: `guarded_h11` closes them; /health is always answered);
  4. the size: a Content-Length over the cap is refused unread (413), a body without one is
     counted as it arrives and refused once it passes the cap; a body not in within
     `read_timeout_s` is refused (408).
A refusal closes the connection, so the rest of a refused body is never read. Then the body is
measured before it is parsed (`json_shape`: nesting depth and number of arrays and objects, with bytes-level
scans at C speed), parsed on a worker thread (never on the event loop), checked for lone
surrogates (400 naming the field); a "bytes" route gets `{"raw": the body}` instead (the Tinker
SDK's protobuf requests), and path parameters such as `{model_id}` join the object. The route's
handler runs on a worker thread (engine work waits there for the engine loop,
ridgeline.inference.scheduler). A handler may answer an `EventStream` (sent as server-sent events)
or a `RawAnswer` (bytes, their media type and status: a protobuf message, Tinker's 408 "try
again") instead of JSON. Errors map to statuses: RequestError 400
naming the field, ServerBusy / RequestTimedOut 503, a weight-sync failure 400, anything else 500
(logged). They take the shape of the route's API family: {"error": {message, type, param, code}}
(OpenAI's, for /v1/*; SGLang's native routes answer the same, which holds SGLang's
{"error": {"message"}}), and SGLang's {"success": false, "message"} for the weight and memory
routes.

fastapi and uvicorn are imported when a server is built: a training run without an endpoint
never needs them.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Literal

from ridgeline.inference.request_fields import RequestError
from ridgeline.inference.scheduler import RequestTimedOut, ServerBusy
from ridgeline.inference.weight_transport import WeightSyncError, is_loopback

if TYPE_CHECKING:
    from fastapi import FastAPI, Request, Response

log = logging.getLogger(__name__)

ApiFamily = Literal["openai", "native", "weights"]
OPEN_ROUTES = ("/health", "/api/v1/healthz")  # answered without the key: load balancers and launchers poll them


@dataclass(frozen=True)
class Route:
    """One route. Its family gives the shape of its error answers; the "weights" family (SGLang's
    weight, memory and cache routes) changes what the engine serves, so it is never served beyond
    loopback without a key (`check_exposure`). The open routes (/health) are answered on the event
    loop without reading a body: their handler must be instant."""

    method: Literal["GET", "POST"]  # a GET route answers POST too, as SGLang's do
    path: str
    handler: Callable[[dict], Any]
    family: ApiFamily
    body: Literal["json", "bytes"] = "json"


@dataclass(frozen=True)
class RawAnswer:
    """A handler's answer sent as it is (e.g. a protobuf message), with its media type and status."""

    content: bytes
    media_type: str
    status: int = 200


@dataclass(frozen=True)
class EventStream:
    """An answer sent as server-sent events (`stream=true`): each event one `data: {json}` line,
    then `data: [DONE]`, as vLLM's and SGLang's servers send them."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> str:
        return "".join(f"data: {json.dumps(e)}\n\n" for e in self.events) + "data: [DONE]\n\n"


@dataclass(frozen=True)
class HttpLimits:
    """What one request may cost the HTTP layer before a handler sees it."""

    max_body_bytes: int          # --max-body-mb
    max_requests: int            # requests in progress (reading, waiting, running); 503 beyond
    max_json_depth: int = 32     # nesting of arrays and objects (an OpenAI chat request needs 5)
    # arrays and objects: ~64-byte objects from 2-3 bytes of JSON (60 MiB of `[],`: 20 M lists, +1.5 GB);
    # scalars cost at most ~12x their bytes, bounded by the body cap
    max_json_containers: int = 1_000_000
    read_timeout_s: float = 60.0  # from the end of the headers to the end of the body (408 beyond)


class ExposureError(ValueError):
    """Weight and memory routes listening beyond this machine without a key."""


def check_exposure(host: str, api_key: str | None, *, steering: bool) -> None:
    """Refuse to serve `steering` routes (weights, memory, cache) beyond loopback without a key."""
    if api_key or not steering or is_loopback(host):
        return
    raise ExposureError(f"--host {host} listens beyond this machine without an API key, so anyone who reaches the "
                        "port could load weights from any path or release the engine's memory. Fix: pass --api-key "
                        "KEY (or export RIDGELINE_ENGINE_API_KEY=KEY), or keep the default --host 127.0.0.1.")


def error_answer(family: ApiFamily, status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    if family == "weights":
        return {"success": False, "message": message}
    return {"error": {"message": message, "type": status.phrase, "param": param, "code": int(status)}}


def build_app(routes: list[Route], *, api_key: str | None, limits: HttpLimits, workers: int) -> FastAPI:
    """The FastAPI app of `routes`; `workers` bounds the handler threads (engine work waits in them)."""
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException

    gate = _Gate(api_key or None, limits, workers)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    for route in routes:
        methods = ["GET", "POST"] if route.method == "GET" else ["POST"]
        # a plain Starlette route: the handler reads the request itself (no parameter injection)
        app.add_route(route.path, gate.endpoint(route), methods=methods, include_in_schema=False)

    paths = {route.path for route in routes}

    @app.exception_handler(HTTPException)
    async def not_routed(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        family: ApiFamily = "openai" if path.startswith("/v1/") else "native"
        status = HTTPStatus(exc.status_code)
        message = f"no route {request.method} {path}"
        if status == HTTPStatus.NOT_FOUND and "/v1" + path in paths:
            # an OpenAI client given the server's address without /v1 asks for /chat/completions
            family, message = "openai", (f"{message}: the OpenAI routes are under /v1. Fix: the client's base_url "
                                         f"ends in /v1, e.g. base_url=\"{request.base_url}v1\"")
        return _json(error_answer(family, status, message), status)

    return app


class BodyRefused(ValueError):
    """A body refused before or while it is parsed: `status` (400 / 413) and the field at fault."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


_STRING = re.compile(rb'"[^"]*"')  # a JSON string once its escaped backslashes and quotes are gone
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _containers(text: bytes | bytearray) -> int:
    return text.count(b"[") + text.count(b"{")


def json_shape(raw: bytes | bytearray, limits: HttpLimits) -> None:
    """Refuse a body whose parse would cost more than its size says: more than
    `max_json_containers` arrays and objects (60 MiB of `[],` is 20 M lists, +1.5 GB parsed), or nesting
    deeper than `max_json_depth` (the parser recurses). Each scan is a bytes method (C speed,
    ~0.3 s for 64 MiB): escapes and strings are cut first, so text inside strings never counts."""
    bare = _STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b"")) if b'"' in raw else raw
    containers = _containers(bare)
    if containers > limits.max_json_containers:
        raise BodyRefused(f"the request body holds {containers} JSON arrays and objects, more than this server's "
                          f"limit of {limits.max_json_containers}", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    brackets = bare.translate(None, _NOT_BRACKETS)
    for _ in range(limits.max_json_depth):  # each pass removes at least the innermost level
        if not brackets:
            return
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if inner == brackets:  # no innermost pair left: the brackets do not balance
            raise BodyRefused("the body is not JSON: its brackets do not balance")
        brackets = inner
    if brackets:
        raise BodyRefused(f"the request body nests arrays and objects more than {limits.max_json_depth} deep "
                          "(this server's limit)")


def parse_body(raw: bytes | bytearray, limits: HttpLimits) -> dict[str, Any]:
    """The request's JSON object, measured first (`json_shape`); a string holding a lone
    surrogate (which no tokenizer can encode) is refused naming its field."""
    json_shape(raw, limits)
    try:
        body = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyRefused(f"the body is not JSON: {e}") from e
    except RecursionError as e:  # json_shape bounds the depth; the interpreter's stack may be smaller
        raise BodyRefused("the request body nests arrays and objects too deep to parse") from e
    if not isinstance(body, dict):
        raise BodyRefused("the request body must be a JSON object")
    bad = _lone_surrogate(body, "")
    if bad is not None:
        raise BodyRefused(f"{bad} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is no "
                          "character: send valid Unicode", param=bad)
    return body


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (`messages[0].content`) of the first string, key or value, that cannot be UTF-8."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key, "") is not None:
            return here
        found = _lone_surrogate(item, here)
        if found is not None:
            return found
    return None


class _Gate:
    def __init__(self, api_key: str | None, limits: HttpLimits, workers: int):
        self.api_key, self.limits, self.workers = api_key, limits, workers
        self.max_body_bytes = limits.max_body_bytes
        self._limiter = self._parsers = None  # made in the event loop (anyio needs one running)
        self._in_progress = 0  # only touched on the event loop

    def endpoint(self, route: Route) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            # /health is answered whatever the load, on the loop, without reading a body (it takes
            # none), so bodies sent slowly by many clients cannot make a load balancer drop the server
            if route.path in OPEN_ROUTES:
                response = _json(route.handler({}), HTTPStatus.OK)
                if "content-length" in request.headers or "transfer-encoding" in request.headers:
                    response.headers["Connection"] = "close"  # the body is never read
                return response
            if self._in_progress >= self.limits.max_requests:
                status = HTTPStatus.SERVICE_UNAVAILABLE
                return _refuse(route.family, status, f"{self._in_progress} requests are in progress, this server's "
                                                     "limit; retry later")
            self._in_progress += 1
            try:
                return await self.handle(route, request)
            finally:
                self._in_progress -= 1
        return handle

    async def handle(self, route: Route, request: Request) -> Response:
        import anyio

        if self.api_key and route.path not in OPEN_ROUTES and not self._authorized(request):
            return _refuse(route.family, HTTPStatus.UNAUTHORIZED,
                           "missing or wrong bearer token: send Authorization: Bearer <the server's --api-key> "
                           "(or X-API-Key: <key>, as the Tinker SDK does from TINKER_API_KEY)")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return _refuse(route.family, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large(declared))
        raw = bytearray()
        with anyio.move_on_after(self.limits.read_timeout_s) as reading:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > self.max_body_bytes:
                    return _refuse(route.family, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large(None))
        if reading.cancelled_caught:
            return _refuse(route.family, HTTPStatus.REQUEST_TIMEOUT,
                           f"the request body did not arrive within {self.limits.read_timeout_s:g}s")
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.workers)
            self._parsers = anyio.CapacityLimiter(2)  # parsing holds the GIL: more threads would not help
        if route.body == "bytes":
            body: dict[str, Any] = {"raw": bytes(raw)}
        else:
            try:
                body = await anyio.to_thread.run_sync(parse_body, raw, self.limits, limiter=self._parsers)
            except BodyRefused as e:
                return _json(error_answer(route.family, e.status, str(e), e.param), e.status)
        del raw
        body.update(request.path_params)
        try:
            # abandoned on cancel: a server shutting down does not wait for the engine
            result = await anyio.to_thread.run_sync(route.handler, body, limiter=self._limiter, abandon_on_cancel=True)
        except RequestError as e:
            status = HTTPStatus(e.status)
            return _json(error_answer(route.family, status, str(e), e.param), status)
        except (ServerBusy, RequestTimedOut) as e:
            status = HTTPStatus.SERVICE_UNAVAILABLE
            return _json(error_answer(route.family, status, str(e)), status)
        except WeightSyncError as e:
            return _json({"success": False, "message": str(e)}, HTTPStatus.BAD_REQUEST)
        except Exception as e:  # noqa: BLE001 - the client gets the error instead of a dropped connection
            log.exception("%s %s failed", request.method, route.path)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            return _json(error_answer(route.family, status, f"{type(e).__name__}: {e}"), status)
        if isinstance(result, EventStream):
            from fastapi import Response

            return Response(result.body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if isinstance(result, RawAnswer):
            from fastapi import Response

            return Response(result.content, status_code=result.status, media_type=result.media_type)
        failed = isinstance(result, dict) and result.get("success") is False
        return _json(result, HTTPStatus.BAD_REQUEST if failed else HTTPStatus.OK)

    def _authorized(self, request: Request) -> bool:
        bearer = request.headers.get("authorization", "")
        key = request.headers.get("x-api-key", "")
        # both compared, always: the time taken does not say which header was tried
        return (secrets.compare_digest(bearer.encode(), f"Bearer {self.api_key}".encode())
                | secrets.compare_digest(key.encode(), self.api_key.encode()))

    def _too_large(self, declared: str | None) -> str:
        size = f"{declared} bytes" if declared is not None and declared.isdigit() else "more"
        return (f"the request body ({size}) is over this server's limit of {self.max_body_bytes} bytes "
                "(--max-body-mb)")


def _json(body: Any, status: HTTPStatus) -> Response:
    from fastapi import Response

    # json.dumps as the old server: a -inf logprob stays a number (-Infinity), as Python clients read it
    return Response(json.dumps(body), status_code=int(status), media_type="application/json")


def _refuse(family: ApiFamily, status: HTTPStatus, message: str) -> Response:
    """An answer given before the body was read: the connection closes, so the body never is."""
    response = _json(error_answer(family, status, message), status)
    response.headers["Connection"] = "close"
    return response


def guarded_h11(header_timeout_s: float, max_open: int) -> type:
    """uvicorn's h11 protocol with the two guards it lacks (it has a keep-alive timeout after a
    response, and a header size cap, but no header timeout, and it counts idle connections against
    its concurrency limit): a request's headers must be complete within `header_timeout_s` of the
    connection or of the request's first byte, else the connection closes; past `max_open`
    connections, a new one closes the oldest that has no request in progress (half-sent headers,
    keep-alive), so such connections never lock real requests out (slowloris)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _header_timer = None
        _opened = 0.0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened = self.loop.time()
            self._arm_header_timer()
            if len(self.connections) > max_open:
                idle = [c for c in self.connections if c is not self and c._idle()]
                if idle:
                    min(idle, key=lambda c: c._opened).transport.close()

        def _idle(self) -> bool:
            """No request in progress: its headers are not all in yet (uvicorn makes a cycle for a
            request once they are), or its answer has been sent."""
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_overdue)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._idle():
                self._cancel_header_timer()
            elif self._header_timer is None:  # the first bytes of the next request on a kept-alive connection
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11


class HttpServer:
    """uvicorn serving `app` on a socket bound here: a taken port fails at construction (OSError),
    port 0 picks a free one (`server_address`). `serve_forever` / `shutdown` / `server_close` as
    the standard library's servers: run `serve_forever` in a thread of its own. Requests in
    progress are bounded by the app (`HttpLimits.max_requests`), open connections here
    (`max_open`, idle ones closed first: `guarded_h11`)."""

    def __init__(self, app: FastAPI, host: str, port: int, *, backlog: int, max_open: int,
                 header_timeout_s: float):
        import uvicorn

        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(backlog)
        except OSError:
            self.socket.close()
            raise
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        # h11 and asyncio: no optional speedups, no process-wide event-loop policy (a training run
        # serves from a thread of its own); log_config=None leaves the process's logging alone
        config = uvicorn.Config(app, http=guarded_h11(header_timeout_s, max_open), loop="asyncio", lifespan="off",
                                log_config=None, log_level="warning", access_log=False, backlog=backlog,
                                timeout_graceful_shutdown=3, server_header=False)
        self._server = uvicorn.Server(config)
        self._stopped = threading.Event()
        self._stopped.set()

    def serve_forever(self) -> None:
        self._stopped.clear()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving; returns once `serve_forever` has returned."""
        self._server.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
