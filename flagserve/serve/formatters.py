"""Engine chunks -> OpenAI response bodies and SSE events, for completions and chat.

Streams take batches of (prompt index, chunk) (streams.batches) and write one SSE event
per batch: the chunks of one choice in a batch are merged into one delta, and every choice
with something to say goes into the same event (`choices` is a list in OpenAI's format)."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from flagserve.serve.engine_loop import EngineDeadError
from flagserve.serve.messages import ChoiceDelta, EngineChunk, merge_choice
from flagserve.serve.openai_format import (CompletionLogprobs, Header, OpenAIError, Usage,
                                           chat_choice, chat_logprobs, completion_choice,
                                           engine_dead_message, error_message, sse)

log = logging.getLogger(__name__)
Batches = AsyncIterator[list[tuple[int, EngineChunk]]]


def _merged(batch: list[tuple[int, EngineChunk]]) -> dict[tuple[int, int], ChoiceDelta]:
    """(prompt, choice index) -> the choice's deltas in this batch as one, in arrival order."""
    deltas: dict[tuple[int, int], ChoiceDelta] = {}
    for prompt, chunk in batch:
        for d in chunk.choices:
            key = (prompt, d.index)
            prev = deltas.get(key)
            deltas[key] = d if prev is None else merge_choice(prev, d)
    return deltas


class CompletionFormat:
    def __init__(self, header: Header, n: int, logprobs: int | None):
        self.header, self.n, self.logprobs = header, n, logprobs
        self.usage = Usage()
        self.offsets: dict[int, int] = {}

    def _account(self, chunk: EngineChunk, seen: set[int], prompt: int) -> None:
        if prompt not in seen:
            seen.add(prompt)
            self.usage.prompt_tokens += chunk.num_prompt_tokens
            self.usage.cached_tokens += chunk.num_cached_tokens
        self.usage.completion_tokens += sum(len(c.token_ids) for c in chunk.choices)

    def _choice(self, prompt: int, delta: Any) -> dict[str, Any]:
        index = prompt * self.n + delta.index
        lp = None
        if self.logprobs is not None and delta.logprobs is not None:
            logprobs = CompletionLogprobs()
            logprobs.add(delta.logprobs, delta.token_ids, self.offsets.get(index, 0), self.logprobs)
            lp = logprobs.body()
        self.offsets[index] = self.offsets.get(index, 0) + len(delta.text)
        return completion_choice(index, delta, lp)

    def _worth_sending(self, d: Any) -> bool:
        # Tokens whose text is held back (a partial stop string) are sent with their text.
        return bool(d.text or d.finish_reason or (self.logprobs is not None and d.token_ids))

    async def stream(self, batches: Batches, include_usage: bool) -> AsyncIterator[str]:
        seen: set[int] = set()
        async for batch in batches:
            for prompt, chunk in batch:
                self._account(chunk, seen, prompt)
            choices = [self._choice(prompt, d) for (prompt, _), d in _merged(batch).items()
                       if self._worth_sending(d)]
            if choices:
                yield sse(self.header.body("text_completion", choices))
        if include_usage:
            yield sse(self.header.body("text_completion", [], usage=self.usage.body()))

    async def full(self, batches: Batches) -> dict[str, Any]:
        seen: set[int] = set()
        choices = []
        async for batch in batches:
            for prompt, chunk in batch:
                self._account(chunk, seen, prompt)
                choices += [self._choice(prompt, d) for d in chunk.choices]
        choices.sort(key=lambda c: c["index"])
        return self.header.body("text_completion", choices, usage=self.usage.body())


class ChatFormat:
    def __init__(self, header: Header, n: int, top_logprobs: int | None):
        self.header, self.n, self.top = header, n, top_logprobs
        self.usage = Usage()

    def _account(self, chunk: EngineChunk) -> None:
        self.usage.prompt_tokens = chunk.num_prompt_tokens
        self.usage.cached_tokens = chunk.num_cached_tokens
        self.usage.completion_tokens += sum(len(c.token_ids) for c in chunk.choices)

    def _logprobs(self, delta: Any) -> list | None:
        if self.top is None or delta.logprobs is None:
            return None
        return chat_logprobs(delta.logprobs, delta.token_ids, self.top)

    async def stream(self, batches: Batches, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk"
        yield sse(self.header.body(obj, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}
                                         for i in range(self.n)]))
        async for batch in batches:
            for _, chunk in batch:
                self._account(chunk)
            choices = []
            for d in _merged(batch).values():
                if not (d.text or d.finish_reason or (self.top is not None and d.token_ids)):
                    continue
                lp = self._logprobs(d)
                choices.append({"index": d.index, "delta": {"content": d.text} if d.text else {},
                                "logprobs": {"content": lp} if lp is not None else None,
                                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason})
            if choices:
                yield sse(self.header.body(obj, choices))
        if include_usage:
            yield sse(self.header.body(obj, [], usage=self.usage.body()))

    async def full(self, batches: Batches) -> dict[str, Any]:
        choices = []
        async for batch in batches:
            for _, chunk in batch:
                self._account(chunk)
                choices += [chat_choice(d.index, d.text, d, self._logprobs(d))
                            for d in chunk.choices]
        choices.sort(key=lambda c: c["index"])
        return self.header.body("chat.completion", choices, usage=self.usage.body())


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as err:  # noqa: BLE001 - the status line is sent; report in-band
            log.exception("stream failed")
            if isinstance(err, EngineDeadError):
                body = OpenAIError(503, engine_dead_message(err)).body()
            else:
                body = OpenAIError(400 if isinstance(err, ValueError) else 500, error_message(err)).body()
            yield sse(body)
        yield sse("[DONE]")
    return StreamingResponse(body(), media_type="text/event-stream")
