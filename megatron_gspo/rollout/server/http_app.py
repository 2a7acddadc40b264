"""The embedded rollout server's HTTP layer: aiohttp in front of a route table.

aiohttp because it gives what the stdlib server lacked: a real listen backlog (64 clients
opening fresh connections at once are queued, not reset), a C parser that answers broken
framing (negative / non-numeric / overflowing Content-Length, ...) with a 400 naming the
header, and a body-size limit answered with 413 (nothing past the limit is buffered).

The event loop only moves bytes. Every endpoint call, body decoding and JSON encoding
included, runs in a thread pool chosen by path: a /generate call blocks its thread until the
batch it joined is done (`BatchScheduler` batches concurrent calls, so that pool must hold at
least a batch's worth of threads), a weight reload takes seconds.

A route is `endpoint(body) -> (status, payload)`: `body` is the decoded JSON of a POST (`{}`
for GET), `payload` a str (sent as text/plain) or anything JSON-encodable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import signal
import socket
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

logger = logging.getLogger(__name__)

Endpoint = Callable[[Any], tuple[int, Any]]
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
SHUTDOWN_GRACE_S = 5.0
"""How long requests in flight at SIGTERM / Ctrl-C get to finish (aiohttp's default is 60 s)."""


class HTTP2ProbeFilter(logging.Filter):
    """One line, not an error with a traceback, for a client opening with HTTP/2's preface.

    SGLang's router probes each worker it registers over gRPC (HTTP/2) as well as HTTP; aiohttp
    answers that connection with a 400 and would log it as a failed request.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """False (dropped, logged as one line) for the preface's 400; True for anything else."""
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and "PRI" in str(error):
            logger.info("answered 400 to an HTTP/2 connection (a router probing for a gRPC worker)")
            return False
        return True


class BodyError(ValueError):
    """A request body that is not a UTF-8 JSON document (HTTP 400)."""


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body (`{}` when empty); BodyError says what is wrong."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(
            f"request body is not UTF-8: invalid byte {raw[exc.start]:#04x} at {exc.start}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BodyError(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise BodyError("request body is JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BodyError(f"request body is not JSON this server accepts: {exc}") from None


def _encode(status: int, payload: Any) -> tuple[int, bytes, str]:
    if isinstance(payload, str):
        return int(status), payload.encode(), "text/plain"
    # NaN stays NaN (Python's JSON dialect): the client's validation names the field it is in.
    return int(status), json.dumps(payload).encode(), "application/json"


def _error(status: int, message: str) -> tuple[int, bytes, str]:
    return _encode(status, {"error": {"message": message}})


def call_endpoint(endpoint: Endpoint, raw: bytes | None, path: str) -> tuple[int, bytes, str]:
    """Decode, run and encode one call (in a pool thread); any failure becomes an HTTP answer."""
    try:
        body = {} if raw is None else decode_body(raw)
        return _encode(*endpoint(body))
    except BodyError as exc:
        return _error(HTTPStatus.BAD_REQUEST, str(exc))
    except RecursionError:  # parsed, but too deep for a check or the contract walking it
        return _error(HTTPStatus.BAD_REQUEST, "request body is JSON nested too deeply")
    except Exception as exc:  # noqa: BLE001 - a bug must still answer, not drop the connection
        logger.exception("error serving %s", path)
        return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")


def build_app(
    get_routes: Mapping[str, Endpoint],
    post_routes: Mapping[str, Endpoint],
    pool_for: Callable[[str], cf.Executor],
    *,
    max_body_bytes: int,
) -> web.Application:
    """An aiohttp application dispatching `path -> endpoint` tables, each call in `pool_for(path)`."""
    routes = {"GET": get_routes, "POST": post_routes}

    async def dispatch(request: web.Request) -> web.StreamResponse:
        endpoint = routes.get(request.method, {}).get(request.path)
        if endpoint is None:
            known = any(request.path in table for table in routes.values())
            status = HTTPStatus.METHOD_NOT_ALLOWED if known else HTTPStatus.NOT_FOUND
            return web.json_response({"detail": status.phrase}, status=status)
        # read() raises HTTPRequestEntityTooLarge (413) past client_max_size.
        raw = await request.read() if request.method == "POST" else None
        loop = asyncio.get_running_loop()
        status, data, ctype = await loop.run_in_executor(
            pool_for(request.path), call_endpoint, endpoint, raw, request.path
        )
        return web.Response(status=status, body=data, content_type=ctype, charset="utf-8")

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{path:.*}", dispatch)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: the OS picks a free one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


async def _serve(app: web.Application, sock: socket.socket) -> None:
    logging.getLogger("aiohttp.server").addFilter(HTTP2ProbeFilter())
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    # SIGTERM and Ctrl-C end the loop at a point of its choosing: a KeyboardInterrupt raised from
    # a Python signal handler lands in whatever callback runs, and can leave a request's future
    # unresolved, so that shutdown waits on it.
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
        await stop.wait()
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
        await runner.cleanup()


def serve(app: web.Application, sock: socket.socket) -> None:
    """Serve `app` on the bound `sock` until SIGTERM or SIGINT (main thread only)."""
    asyncio.run(_serve(app, sock))
