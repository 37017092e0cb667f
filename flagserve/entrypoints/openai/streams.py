"""The engine streams of one request -> batches of everything that has arrived.

The ingress writes one SSE event per batch, not per engine chunk: when chunks back up (the
client, the proxy or this event loop is slower than the engine for a moment) they leave as
one event carrying several tokens, instead of a burst of events that costs the same Python
work per token all the way to the client."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

_DONE = object()


async def batches(streams: list[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
    """Items of `streams`, tagged with their stream's index, in batches of all items that
    arrived since the previous batch was taken (in arrival order, never empty)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _DONE))
        except BaseException as err:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            batch: list[tuple[int, Any]] = []
            error: BaseException | None = None
            entry = await queue.get()
            while True:
                i, item = entry
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    error = item
                    break
                else:
                    batch.append(entry)
                if queue.empty():
                    break
                entry = queue.get_nowait()
            if batch:
                yield batch
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_close(stream: AsyncIterator, cancels: list[Callable[[], None]]) -> AsyncIterator:
    """Closing early (client disconnect) closes `stream` and cancels the engine calls: the
    engine aborts them."""
    done = False
    try:
        async for item in stream:
            yield item
        done = True
    finally:
        await stream.aclose()
        if not done:
            for cancel in cancels:
                cancel()


async def prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
