"""HTTP plumbing shared by the OpenAI and KServe doors (Starlette/ASGI): bounded body reads, error bodies,
server-sent events, and running a request while watching for the client to go away."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsflash.serve.api.security import APIError, check_json_object

log = logging.getLogger("dsflash.serve")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def read_json(request: Request, limit: int) -> dict:
    """The body as one JSON object; 413 past `limit` bytes (checked on Content-Length and while reading)."""
    return check_json_object(await read_body(request, limit), limit)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 past `limit` bytes (checked on Content-Length and while reading)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is {length} bytes; the limit is {limit} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def openai_error(e: APIError) -> JSONResponse:
    body = {"object": "error", "message": e.message, "type": e.kind, "code": e.status}
    return JSONResponse({"error": body, **body}, status_code=e.status, headers=e.headers())


def kserve_error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers())


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel it (its cleanup aborts the request) and raise ClientGone.
    Call after the body has been read: the next ASGI message can then only be the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - it was cancelled on purpose
        pass
    raise ClientGone()


class EventStream(Response):
    """`text/event-stream` from an async iterator of already-formatted events (`data: ...\\n\\n`).

    Runs the iterator and a disconnect watcher side by side: when the client goes away the iterator is closed at
    once (its cleanup aborts the request), even while the request is still waiting in the queue."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None):
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # no content-length: the body is open-ended
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump():
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled() and task.exception() is not None \
                    and not isinstance(task.exception(), OSError):
                log.error("event stream failed", exc_info=task.exception())
        finally:
            for t in (task, watch):
                t.cancel()
            for t in (task, watch):
                try:
                    await t
                except BaseException:  # noqa: BLE001 - cancelled, or the client went away mid-send
                    pass
            await self.events.aclose()
            if self.on_close is not None:
                await self.on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
