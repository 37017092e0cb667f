"""Merge the streams of a batch of prompts into one, tagging each item with its prompt."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

_DONE = object()


async def merge(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _DONE))
        except BaseException as err:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_close(stream: AsyncIterator, gens: list[Any]) -> AsyncIterator:
    """Closing early (client disconnect) cancels the engine calls: the engine aborts them."""
    done = False
    try:
        async for item in stream:
            yield item
        done = True
    finally:
        if not done:
            for gen in gens:
                gen.cancel()


async def prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
