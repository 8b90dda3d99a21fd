"""HTTP serving for `ridgeline serve` and a training run's endpoint: FastAPI routes on uvicorn (the
stack of vLLM's and SGLang's servers), on a socket bound when the server is built.

Every request passes one gate, in this order, before its body is read:
  1. the route (404 / 405 otherwise);
  2. the key: with an API key, every route but /health needs `Authorization: Bearer <key>` or
     `X-API-Key: <key>` (the Tinker SDK's header; 401);
  3. the size: a Content-Length over the cap is refused unread (413), a body without one is
     counted as it arrives and refused once it passes the cap.
A refusal closes the connection, so the rest of a refused body is never read. Then the body is
parsed (a JSON object; a "bytes" route gets `{"raw": the body}`: the Tinker SDK's protobuf
requests; path parameters such as `{model_id}` join the object) and the route's handler runs on a
worker thread (engine work waits there for the engine loop, ridgeline.inference.scheduler).
Errors map to statuses: RequestError 400 naming the field, ServerBusy / RequestTimedOut 503, a
weight-sync failure 400, anything else 500 (logged). They take the shape of the route's API
family: {"error": {message, type, param, code}} (OpenAI's, for /v1/*; SGLang's native routes
answer the same, which holds SGLang's {"error": {"message"}}), and SGLang's {"success": false,
"message"} for the weight and memory routes. A handler may answer a `RawAnswer` (bytes, their
media type and status: a protobuf message, Tinker's 408 "try again") instead of JSON.

fastapi and uvicorn are imported when a server is built: a training run without an endpoint
never needs them.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
from dataclasses import dataclass
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
    loopback without a key (`check_exposure`)."""

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


def build_app(routes: list[Route], *, api_key: str | None, max_body_bytes: int, workers: int) -> FastAPI:
    """The FastAPI app of `routes`; `workers` bounds the handler threads (engine work waits in them)."""
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException

    gate = _Gate(api_key or None, max_body_bytes, workers)
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


class _Gate:
    def __init__(self, api_key: str | None, max_body_bytes: int, workers: int):
        self.api_key, self.max_body_bytes, self.workers = api_key, max_body_bytes, workers
        self._limiter = None  # made in the event loop (anyio needs one running)

    def endpoint(self, route: Route) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            return await self.handle(route, request)
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
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                return _refuse(route.family, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large(None))
        if route.body == "bytes":
            body: Any = {"raw": bytes(raw)}
        else:
            try:
                body = json.loads(raw) if raw else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return _json(error_answer(route.family, HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}"),
                             HTTPStatus.BAD_REQUEST)
            if not isinstance(body, dict):
                return _json(error_answer(route.family, HTTPStatus.BAD_REQUEST,
                                          "the request body must be a JSON object"), HTTPStatus.BAD_REQUEST)
        body.update(request.path_params)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.workers)
        try:
            # abandoned on cancel: a server shutting down does not wait for the engine
            result = await anyio.to_thread.run_sync(route.handler, body, limiter=self._limiter, abandon_on_cancel=True)
        except RequestError as e:
            return _json(error_answer(route.family, HTTPStatus.BAD_REQUEST, str(e), e.param), HTTPStatus.BAD_REQUEST)
        except (ServerBusy, RequestTimedOut) as e:
            status = HTTPStatus.SERVICE_UNAVAILABLE
            return _json(error_answer(route.family, status, str(e)), status)
        except WeightSyncError as e:
            return _json({"success": False, "message": str(e)}, HTTPStatus.BAD_REQUEST)
        except Exception as e:  # noqa: BLE001 - the client gets the error instead of a dropped connection
            log.exception("%s %s failed", request.method, route.path)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            return _json(error_answer(route.family, status, f"{type(e).__name__}: {e}"), status)
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


class HttpServer:
    """uvicorn serving `app` on a socket bound here: a taken port fails at construction (OSError),
    port 0 picks a free one (`server_address`). `serve_forever` / `shutdown` / `server_close` as
    the standard library's servers: run `serve_forever` in a thread of its own."""

    def __init__(self, app: FastAPI, host: str, port: int, *, backlog: int, max_connections: int):
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
        config = uvicorn.Config(app, http="h11", loop="asyncio", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, backlog=backlog,
                                limit_concurrency=max_connections, timeout_graceful_shutdown=3, server_header=False)
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
