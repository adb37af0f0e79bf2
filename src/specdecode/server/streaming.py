"""Waiting for the engine on the event loop: results, server-sent events, clients that leave.

Handlers never block: they await the request's Future (or its text deltas) while polling
whether the client is still there; one that left has its request cancelled, which frees
its batch slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from specdecode.engine import GenerationResult
from specdecode.server.errors import APIError, engine_error
from specdecode.server.metrics import ServerMetrics
from specdecode.server.worker import RequestHandle, TextDelta

DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


async def outcomes(handles: list[RequestHandle], http: Request, prompt_param: str) -> list[GenerationResult]:
    """Every choice's result; if one fails, the others are not wanted any more."""
    try:
        return await asyncio.gather(*(_outcome(h, http, prompt_param) for h in handles))
    finally:
        for handle in handles:
            handle.cancel()  # a finished request ignores it


async def stream(
    handles: list[RequestHandle],
    http: Request,
    metrics: ServerMetrics,
    prompt_param: str,
    opening: list[BaseModel],
    chunk: Callable[..., BaseModel | None],
    tail: Callable[[list[GenerationResult]], list[BaseModel]],
) -> StreamingResponse:
    """Server-sent events: the opening chunks, one chunk per piece of a choice's new text
    (chunk(text, index=choice, logprobs=...): its tokens' log-probabilities, when asked), as
    the choices' pieces come, the tail (each choice's finish reason, usage), then [DONE]. An
    error before the first text is an ordinary error response; one after it is an error
    event, as OpenAI sends, and the other choices are not wanted any more."""
    deltas = _merged(handles)
    first = await _unless_client_leaves(anext(deltas, None), handles, http)  # through the queue and the prefill
    failed = _failure(handles)
    if first is None and failed is not None:
        raise engine_error(failed, prompt_param)

    async def events() -> AsyncIterator[str]:
        try:
            for event in opening:
                yield _event(event)
            if first is not None:
                async for index, delta in _chain(first, deltas):
                    if (event := chunk(delta.text, index=index, logprobs=delta.logprobs)) is not None:
                        yield _event(event)  # None: held back (a chat answer that may be a tool call)
            error = _failure(handles)
            if error is None:
                for event in tail([handle.future.result() for handle in handles]):
                    yield _event(event)
            else:
                api_error = engine_error(error, prompt_param)
                metrics.errors.labels(api_error.code or api_error.type).inc()
                yield f"data: {json.dumps({'error': api_error.detail().model_dump()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for handle in handles:
                handle.cancel()  # the client may have gone mid-stream; a finished request ignores it

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Every choice's text deltas, (choice, delta), in the order they come; ends when every
    choice has ended, or at once when one fails (the others are cancelled by the caller)."""
    queue: asyncio.Queue[tuple[int, TextDelta | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for delta in handle.text_deltas():
            await queue.put((index, delta))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            index, delta = await queue.get()
            if delta is not None:
                yield index, delta
                continue
            running -= 1
            if _failure([handles[index]]) is not None:
                return
    finally:
        for task in tasks:
            task.cancel()


async def _chain(first: tuple[int, TextDelta], rest: AsyncIterator[tuple[int, TextDelta]]):
    yield first
    async for item in rest:
        yield item


def _failure(handles: list[RequestHandle]) -> BaseException | None:
    """The first choice's error that has failed, if any (a cancelled one has none)."""
    for handle in handles:
        if handle.future.done() and not handle.future.cancelled() and handle.future.exception() is not None:
            return handle.future.exception()
    return None


async def _outcome(handle: RequestHandle, http: Request, prompt_param: str) -> GenerationResult:
    waiter = asyncio.wrap_future(handle.future)
    try:
        return await _unless_client_leaves(waiter, [handle], http)
    except asyncio.CancelledError:  # the worker dropped it: the client had gone
        raise APIError(499, "the client closed the request", code="client_disconnected") from None
    except APIError:
        raise
    except Exception as error:  # noqa: BLE001 - what failed the request in the engine
        raise engine_error(error, prompt_param) from None


async def _unless_client_leaves(awaitable: Awaitable, handles: list[RequestHandle], http: Request):
    """Await awaitable; if the client disconnects meanwhile, free the requests' places and give up."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await http.is_disconnected():
            for handle in handles:
                handle.cancel()
            task.cancel()
            raise APIError(499, "the client closed the request", code="client_disconnected")
    return task.result()


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
