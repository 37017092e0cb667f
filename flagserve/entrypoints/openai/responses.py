"""Engine chunks -> OpenAI response bodies and SSE events, for completions and chat.

Plain dicts, not pydantic models: this runs once per streamed chunk. Streams take batches of
(prompt index, chunk) (streams.batches) and write one SSE event per batch: the chunks of one
choice in a batch are merged into one delta, and every choice with something to say goes
into the same event (`choices` is a list in OpenAI's format)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi.responses import Response, StreamingResponse

from flagserve.engine.core.loop import EngineDeadError
from flagserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    SampleLogprobs,
    merge_completion,
)
from flagserve.entrypoints.openai.engine_client import EngineChunk
from flagserve.entrypoints.openai.errors import OpenAIError, engine_dead_message, error_message
from flagserve.entrypoints.openai.tool_output import ToolOutput, full_message, stream_step

log = logging.getLogger(__name__)
Batches = AsyncIterator[list[tuple[int, EngineChunk]]]
# stream_options: no usage, a last event with the request's usage (include_usage), or also the
# usage so far in every event (continuous_usage_stats, vLLM's)
StreamUsage = Literal["none", "last", "every"]


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def so_far(self, usage: StreamUsage) -> dict[str, Any]:
        """A streamed event's `usage` field: the counts so far, where every event carries them."""
        return {"usage": self.body()} if usage == "every" else {}


@dataclass
class Header:
    """Fields every response and chunk of one request repeats."""
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


@dataclass
class Echo:
    """A prompt as completions' `echo` writes it before each of its choices."""
    text: str  # the prompt string as given, or a token-id prompt decoded
    token_ids: list[int]
    first_token: str  # the first token's text: no logprob entry carries it (nothing scores it)


# Completions (legacy) logprobs: parallel lists.
@dataclass
class CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entries: Sequence[dict[int, Logprob] | None], token_ids: list[int], offset: int,
            top_n: int, first_token: str = "") -> int:
        """`entries` per token; None (a prompt's first token) lists `first_token` with null
        logprobs, as vLLM. Returns the offset after the last token."""
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                text, logprob, top = first_token, None, None
            else:
                chosen = entry[tid]
                text, logprob = chosen.decoded_token or "", chosen.logprob
                # By rank, not by count: a prompt scored with fewer alternatives than `top_n`
                # (prompt_logprobs < logprobs) must not pass its own token off as a top one.
                ranked = sorted((lp for lp in entry.values() if lp.rank and lp.rank <= top_n),
                                key=lambda lp: lp.rank)
                top = {(lp.decoded_token or ""): lp.logprob for lp in ranked}
                if len(ranked) == top_n:  # OpenAI's "and the chosen token": up to top_n + 1
                    top.setdefault(text, logprob)
            self.tokens.append(text)
            self.token_logprobs.append(logprob)
            self.top_logprobs.append(top)
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def prompt_logprobs_body(entries: PromptLogprobs) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then {token id: its Logprob}."""
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()}
            for entry in entries]


def chat_logprobs(entries: SampleLogprobs, token_ids: list[int], top_n: int) -> list[dict]:
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        ranked = sorted((lp for lp in entry.values() if lp.rank), key=lambda lp: lp.rank)
        out.append({**_token(chosen.decoded_token, chosen.logprob),
                    "top_logprobs": [_token(lp.decoded_token, lp.logprob) for lp in ranked[:top_n]]})
    return out


def _token(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_choice(index: int, text: str, delta: CompletionOutput, logprobs: dict | None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


def chat_choice(index: int, text: str, delta: CompletionOutput, logprobs: list | None,
                tools: ToolOutput | None = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text} if tools is None else full_message(tools, text)
    reason = delta.finish_reason if tools is None else tools.finish_reason(delta.finish_reason)
    return {"index": index, "message": message,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": reason, "stop_reason": delta.stop_reason}


def _merged(batch: list[tuple[int, EngineChunk]]) -> dict[tuple[int, int], CompletionOutput]:
    """(prompt, choice index) -> the choice's deltas in this batch as one, in arrival order."""
    deltas: dict[tuple[int, int], CompletionOutput] = {}
    for prompt, chunk in batch:
        for d in chunk.choices:
            key = (prompt, d.index)
            prev = deltas.get(key)
            deltas[key] = d if prev is None else merge_completion(prev, d)
    return deltas


def _worth_sending(delta: CompletionOutput, logprobs: int | None, token_ids: bool) -> bool:
    # Tokens whose text is held back (a partial stop string) are sent with their text, unless
    # each token's logprobs or ids are asked for.
    return bool(delta.text or delta.finish_reason
                or ((logprobs is not None or token_ids) and delta.token_ids))


async def prompt_only(stream: Batches) -> Batches:
    """`echo` with `max_tokens: 0`: the one token the engine generated dropped, each choice's
    end (and the prompt's logprobs) kept."""
    async for batch in stream:
        yield [(prompt, replace(chunk, choices=[
            CompletionOutput(c.index, "", [], None, None, c.finish_reason, c.stop_reason)
            for c in chunk.choices])) for prompt, chunk in batch]


class CompletionFormat:
    def __init__(self, header: Header, n: int, logprobs: int | None, echoes: list[Echo] | None = None,
                 prompt_ids: list[list[int]] | None = None):
        """`echoes`: one per prompt when the request asks for `echo`; `prompt_ids`: the
        prompts' token ids when it asks for vLLM's return_token_ids (each choice then carries
        `prompt_token_ids` in its first event and its `token_ids`)."""
        self.header, self.n, self.logprobs, self.echoes = header, n, logprobs, echoes
        self.prompt_ids = prompt_ids
        self.ids_sent: set[int] = set()  # choices that have had their prompt_token_ids
        self.usage = Usage()
        self.offsets: dict[int, int] = {}  # choice index -> the text_offset of its next token
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt -> its entries, once come
        # Choices that have had their echo / their prompt_logprobs: each goes out once, with
        # the first event of the choice that has it.
        self.echoed: set[int] = set()
        self.scored: set[int] = set()

    def _account(self, chunk: EngineChunk, seen: set[int], prompt: int) -> None:
        if prompt not in seen:
            seen.add(prompt)
            self.usage.prompt_tokens += chunk.num_prompt_tokens
            self.usage.cached_tokens += chunk.num_cached_tokens
        self.usage.completion_tokens += sum(len(c.token_ids) for c in chunk.choices)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = chunk.prompt_logprobs

    def _choice(self, prompt: int, delta: Any) -> dict[str, Any]:
        index = prompt * self.n + delta.index
        logprobs = CompletionLogprobs() if self.logprobs is not None else None
        echo = self._echo(prompt, index, logprobs)
        start = self.offsets.get(index, 0)
        if logprobs is not None and delta.logprobs is not None:
            # From the tokens' texts, not the text sent: a stream holds back what may start a
            # stop string (or a partial character), and its offsets must be the whole answer's.
            self.offsets[index] = logprobs.add(delta.logprobs, delta.token_ids, start, self.logprobs)
        else:
            self.offsets[index] = start + len(delta.text)
        with_logprobs = logprobs is not None and (echo is not None or delta.logprobs is not None)
        choice = completion_choice(index, (echo or "") + delta.text, delta,
                                   logprobs.body() if with_logprobs else None)
        if prompt in self.prompt_logprobs and index not in self.scored:
            self.scored.add(index)
            choice["prompt_logprobs"] = prompt_logprobs_body(self.prompt_logprobs[prompt])
        if self.prompt_ids is not None:
            if index not in self.ids_sent:
                self.ids_sent.add(index)
                choice["prompt_token_ids"] = self.prompt_ids[prompt]
            choice["token_ids"] = list(delta.token_ids)
        return choice

    def _echo(self, prompt: int, index: int, logprobs: CompletionLogprobs | None) -> str | None:
        """The prompt's text for the choice's first event (its logprobs into `logprobs`),
        then None."""
        if self.echoes is None or index in self.echoed:
            return None
        self.echoed.add(index)
        echo = self.echoes[prompt]
        end = len(echo.text)
        if logprobs is not None:
            entries = self.prompt_logprobs.get(prompt)
            if entries is None:  # the engine's contract: they come with the first token
                raise RuntimeError("echo with logprobs: the engine returned no prompt logprobs")
            # The output's offsets go on from the prompt tokens' (vLLM's), so they keep rising
            # where the given text lacks a token's text (a BOS).
            end = logprobs.add(entries, echo.token_ids, 0, self.logprobs, echo.first_token)
        self.offsets[index] = end
        return echo.text

    def _owes(self, prompt: int, choice: int) -> bool:
        """Whether the prompt's choice has yet to send its echo or prompt_logprobs."""
        index = prompt * self.n + choice
        return ((self.echoes is not None and index not in self.echoed)
                or (prompt in self.prompt_logprobs and index not in self.scored)
                or (self.prompt_ids is not None and index not in self.ids_sent))

    async def stream(self, batches: Batches, usage: StreamUsage) -> AsyncIterator[str]:
        seen: set[int] = set()
        async for batch in batches:
            for prompt, chunk in batch:
                self._account(chunk, seen, prompt)
            choices = [self._choice(prompt, d) for (prompt, _), d in _merged(batch).items()
                       if _worth_sending(d, self.logprobs, self.prompt_ids is not None)
                       or self._owes(prompt, d.index)]
            if choices:
                yield sse(self.header.body("text_completion", choices, **self.usage.so_far(usage)))
        if usage != "none":
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
    def __init__(self, header: Header, n: int, top_logprobs: int | None,
                 tools: Callable[[], ToolOutput] | None = None, prompt_ids: list[int] = (),
                 return_token_ids: bool = False, echo: str = ""):
        """`tools`: makes each choice's ToolOutput when the request has tools (tool_output.py);
        `prompt_ids`: the prompt, its length for the usage of events before the engine's
        first; `return_token_ids` (vLLM's): the response carries them as `prompt_token_ids` (in
        the first event) and each choice its `token_ids`; `echo`: text each choice's content
        starts with (vLLM's chat echo)."""
        self.header, self.n, self.top, self.echo = header, n, top_logprobs, echo
        self.usage = Usage(len(prompt_ids))
        self.ids = {"prompt_token_ids": list(prompt_ids)} if return_token_ids else None
        self.tools = tools
        self.outputs: dict[int, ToolOutput] = {}  # choice index -> its calls so far
        self.prompt_logprobs: PromptLogprobs | None = None  # come, not yet sent

    def _delta(self, d: Any, lp: list | None) -> dict[str, Any] | None:
        """The choice's chunk; None when there is nothing to send yet (a call being held)."""
        delta, reason = ({"content": d.text} if d.text else {}), d.finish_reason
        if self.tools is not None:
            out = self.outputs.setdefault(d.index, self.tools())
            delta, reason = stream_step(out, d.text, reason)
            if not delta and reason is None and lp is None and (self.ids is None or not d.token_ids):
                return None  # a call being held, and nothing per token to send meanwhile
        return {"index": d.index, "delta": delta,
                "logprobs": {"content": lp} if lp is not None else None,
                "finish_reason": reason, "stop_reason": d.stop_reason, **self._token_ids(d)}

    def _whole_choice(self, d: Any) -> dict[str, Any]:
        choice = chat_choice(d.index, d.text, d, self._logprobs(d), self.tools() if self.tools else None)
        if self.echo:  # before the text, after any tool calls were parsed out of it
            choice["message"]["content"] = self.echo + (choice["message"]["content"] or "")
        return {**choice, **self._token_ids(d)}

    def _token_ids(self, d: Any) -> dict[str, Any]:
        return {} if self.ids is None else {"token_ids": list(d.token_ids)}

    def _account(self, chunk: EngineChunk) -> None:
        self.usage.prompt_tokens = chunk.num_prompt_tokens
        self.usage.cached_tokens = chunk.num_cached_tokens
        self.usage.completion_tokens += sum(len(c.token_ids) for c in chunk.choices)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def _take_prompt_logprobs(self) -> dict[str, Any]:
        """vLLM's top-level `prompt_logprobs`, once: {} before they come and after."""
        entries, self.prompt_logprobs = self.prompt_logprobs, None
        return {} if entries is None else {"prompt_logprobs": prompt_logprobs_body(entries)}

    def _logprobs(self, delta: Any) -> list | None:
        if self.top is None or delta.logprobs is None:
            return None
        return chat_logprobs(delta.logprobs, delta.token_ids, self.top)

    async def stream(self, batches: Batches, usage: StreamUsage) -> AsyncIterator[str]:
        obj = "chat.completion.chunk"
        yield sse(self.header.body(obj, [{"index": i, "delta": {"role": "assistant", "content": self.echo},
                                          "logprobs": None, "finish_reason": None}
                                         for i in range(self.n)], **(self.ids or {}),
                                   **self.usage.so_far(usage)))
        async for batch in batches:
            for _, chunk in batch:
                self._account(chunk)
            choices = []
            for d in _merged(batch).values():
                if not _worth_sending(d, self.top, self.ids is not None):
                    continue
                choice = self._delta(d, self._logprobs(d))
                if choice is not None:
                    choices.append(choice)
            scored = self._take_prompt_logprobs()  # in this event even if no choice has news
            if choices or scored:
                yield sse(self.header.body(obj, choices, **scored, **self.usage.so_far(usage)))
        if usage != "none":
            yield sse(self.header.body(obj, [], usage=self.usage.body()))

    async def full(self, batches: Batches) -> dict[str, Any]:
        choices = []
        async for batch in batches:
            for _, chunk in batch:
                self._account(chunk)
                choices += [self._whole_choice(d) for d in chunk.choices]
        choices.sort(key=lambda c: c["index"])
        return self.header.body("chat.completion", choices, usage=self.usage.body(),
                                **self._take_prompt_logprobs(), **(self.ids or {}))


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


async def yielding_json(payload: dict[str, Any]) -> Response:
    """`payload` as JSONResponse renders it, its long lists encoded a slice at a time with the
    event loop let in between: /tokenize of a 16 MiB text returns ~3 million ids, ~0.7 s of
    json.dumps (a thread would not help: the C encoder holds the GIL throughout), which would
    stall every stream this replica serves."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, list) and len(value) > JSON_SLICE:
            slices = []
            for start in range(0, len(value), JSON_SLICE):
                slices.append(_dumps(value[start:start + JSON_SLICE])[1:-1])
                await asyncio.sleep(0)
            encoded = "[" + ",".join(slices) + "]"
        else:
            encoded = _dumps(value)
        parts.append(f"{_dumps(key)}:{encoded}")
    return Response("{" + ",".join(parts) + "}", media_type="application/json")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


JSON_SLICE = 65536  # ids a slice: ~8 ms of encoding between the loop's turns
