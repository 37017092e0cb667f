"""The OpenAI-compatible server: request handling behind the routes of api.py.

Per request (past the API key and the body limit: api.py's middleware): validate, check
against deploy.limits (checks.py), route by `model`, run the model's user modules, tokenize
(here, or in the tokenizer deployment when the config asks for one), then one stream from the
engine through its EngineClient (engine_client.py): in this process when the engine lives
here (deploy.ingress: engine), else one streaming call to the engine deployment. What the
engine streams back is written as SSE events, one per batch of chunks that arrived together (streams.batches).
Responses follow vLLM's OpenAI server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, and its tokenizer routes /tokenize, /detokenize, /tokenizer_info.

HTTP reaches it one of two ways (deploy.http_server): through Ray Serve's proxy, which calls
the ASGI app that __serve_build_asgi_app__ returns, or straight from the client, when every
replica listens on deploy.host:port itself (http_server.py).
"""

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flagserve.config.schema import ApiLimits
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.structured_outputs.params import import_grammar_library
from flagserve.entrypoints.openai.api import build_api
from flagserve.entrypoints.openai.body import check_text, parse_body
from flagserve.entrypoints.openai.checks import (
    check_budget,
    check_chat,
    check_completion,
    check_limits,
    check_list_lengths,
    check_n,
    check_priority,
    check_token_ids,
    tightest,
)
from flagserve.entrypoints.openai.drain import Drain
from flagserve.entrypoints.openai.engine_client import (
    EngineChunk,
    EngineClient,
    EngineRequest,
    EngineSource,
    ModelInfo,
)
from flagserve.entrypoints.openai.errors import OpenAIError, error_message, request_error
from flagserve.entrypoints.openai.http_server import DirectHTTPServer
from flagserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_request,
    tokenize_request,
)
from flagserve.entrypoints.openai.responses import (
    ChatFormat,
    CompletionFormat,
    Echo,
    Header,
    prompt_only,
    sse_response,
    yielding_json,
)
from flagserve.entrypoints.openai.streams import batches, cancel_on_close, prepend
from flagserve.entrypoints.openai.template_input import template_message
from flagserve.entrypoints.openai.tokenizer import PromptTokenizer
from flagserve.entrypoints.openai.tool_output import ToolOutput
from flagserve.entrypoints.openai.tool_parsers import choose_parser
from flagserve.entrypoints.openai.unhonoured import unknown_field_message

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 10.0
VERSION = importlib.metadata.version("flagserve")  # installed by make (editable)

async def whole(fmt: ChatFormat | CompletionFormat, stream: AsyncIterator) -> JSONResponse:
    """A response not streamed; cancelled (its client left: api.py) it closes the engine
    streams, which aborts them, instead of leaving them to finish for nobody."""
    try:
        return JSONResponse(await fmt.full(stream))
    finally:
        await stream.aclose()


@dataclass
class ModelRoute:
    module_id: str
    names: list[str]  # values of `model` that select this module
    engine: EngineSource  # connected in this replica: the engine in process, or a deployment
    tokenizer_path: str
    tokenizer: Any  # DeploymentHandle of the tokenizer deployment; None: tokenize here
    preprocessors: list[tuple[str, Any]]  # user modules, dependencies first
    tool_call_parser: str = "auto"  # tool_parsers.TOOL_PARSERS name; auto: by the chat template


async def call_tokenizer(tokenizers: dict[str, PromptTokenizer], route: ModelRoute, method: str,
                         *args: Any) -> Any:
    """The route's tokenizer's `method`: PromptTokenizer.<method>_async in this process, or
    <method> of the tokenizer deployment (tokenizer_deployment.py), one hop away."""
    if route.tokenizer is None:
        return await getattr(tokenizers[route.module_id], f"{method}_async")(*args)
    return await getattr(route.tokenizer, method).remote(*args)


class OpenAIIngress:
    def __init__(self, routes: list[ModelRoute], api_key: str | None, metrics_hub: Any,
                 listen: tuple[str, int] | None = None, drain_timeout_s: float = 30.0,
                 limits: ApiLimits | None = None, docs: bool = False):
        self.limits = limits or ApiLimits()
        self.docs = docs  # /docs and /openapi.json
        # Bound first, so that a taken port fails the replica's start at once, with a clear error.
        self.http = DirectHTTPServer(*listen, self.limits.max_header_bytes) if listen else None
        self.routes = routes
        self.by_name = {name: r for r in routes for name in [*r.names, r.module_id]}
        self.api_key = api_key
        self.metrics_hub = metrics_hub
        self.drain: Drain | None = None  # the app, wrapped: stop drains it (drain.py)
        self.drain_timeout_s = drain_timeout_s
        self._drained: asyncio.Future | None = None  # the one drain of this replica (drain_http)
        self.infos: dict[str, ModelInfo] = {}
        self.tokenizer_infos: dict[str, dict[str, Any]] = {}  # PromptTokenizer.info() per module
        self.tokenizers: dict[str, PromptTokenizer] = {}
        own_start = [self._load_tokenizers]  # done by the first engine built here, else below

        def meanwhile() -> None:
            while own_start:
                own_start.pop()()

        self.engines: dict[str, EngineClient] = {}  # filled one by one: __del__ stops those made
        for r in routes:
            self.engines[r.module_id] = r.engine.connect(metrics_hub, meanwhile)
        meanwhile()
        # A tokenizer deployment's template is not at hand here: `auto` takes the default parser.
        self.tool_parsers = {r.module_id: choose_parser(r.tool_call_parser, self._template(r))
                             for r in routes}

    def _load_tokenizers(self) -> None:
        # In-process tokenizers (no Ray Serve hop before the engine call).
        self.tokenizers.update({r.module_id: PromptTokenizer(r.tokenizer_path)
                                for r in self.routes if r.tokenizer is None})
        import_grammar_library()  # why: its docstring

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this once the replica is constructed, on its event loop."""
        app = self.drain = Drain(build_api(self))
        if self.http is not None:
            self.http.start(app)
        return app

    async def drain_http(self) -> None:
        """Refuse new requests and let the running ones finish or end them (drain.py), once
        per replica. `stop` calls it on every ingress replica before it deletes the
        application (serve/server.py), so that the engines serve until it is done; Serve's stop
        of the replica (__del__) then finds it done, or runs it."""
        if self.drain is None:
            return
        if self._drained is None:
            self._drained = asyncio.ensure_future(self._drain_once(self.drain))
        await asyncio.shield(self._drained)  # a caller that gives up leaves the drain running

    async def _drain_once(self, drain: Drain) -> None:
        running, cut = await drain.run(self.drain_timeout_s)
        log.info("drained: %d requests were running, %d cut at the %g s timeout",
                 running, cut, self.drain_timeout_s)

    async def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica: drain, then stop."""
        await self.drain_http()
        if self.http is not None:
            await self.http.stop()
        for engine in self.engines.values():
            engine.shutdown()

    # plumbing

    def _template(self, route: ModelRoute) -> str | None:
        tokenizer = self.tokenizers.get(route.module_id)
        return tokenizer.tokenizer.chat_template if tokenizer is not None else None

    async def _info(self, route: ModelRoute) -> ModelInfo:
        if route.module_id not in self.infos:
            self.infos[route.module_id] = await self.engines[route.module_id].info()
        return self.infos[route.module_id]

    def _route(self, model: str | None) -> ModelRoute:
        if model is None:
            return self.routes[0]
        route = self.by_name.get(model)
        if route is None:
            raise OpenAIError(404, f"The model `{model}` does not exist. Served models: "
                              f"{', '.join(n for r in self.routes for n in r.names)}", "model")
        return route

    async def _body(self, request: Request) -> dict[str, Any]:
        body = parse_body(await request.body())
        longest = max([(await self._info(r)).max_model_len for r in self.routes])
        check_list_lengths(body, self.limits, longest)
        return body

    async def _prepare(self, request: Request, model: type) -> tuple[Any, ModelRoute, ModelInfo]:
        body = await self._body(request)
        parsed = parse_request(model, body)
        route = self._route(parsed.model)
        for module_id, handle in route.preprocessors:
            try:
                body = await handle.remote(body)
            except ValueError as err:
                raise OpenAIError(400, f"{module_id}: {error_message(err)}") from None
        if route.preprocessors:
            parsed = self._reparse(model, body, route)
        return parsed, route, await self._info(route)

    @staticmethod
    def _reparse(model: type, body: dict[str, Any], route: ModelRoute) -> Any:
        """The body user modules returned, checked as a client's; what is wrong with it is
        theirs to fix, and they may not send it to another model (their route is this one)."""
        names = ", ".join(module_id for module_id, _ in route.preprocessors)
        try:
            check_text(body)
            parsed = parse_request(model, body)
        except OpenAIError as err:
            raise OpenAIError(500, f"user module(s) {names} returned a body that is not a valid "
                              f"request: {err.message}", err.param) from None
        if parsed.model is not None and parsed.model not in (*route.names, route.module_id):
            raise OpenAIError(500, f"user module(s) {names} set model to {parsed.model!r}; "
                              f"their requests go to {route.names[0]!r}", "model")
        return parsed

    async def _encode_prompts(self, route: ModelRoute, req: Any, info: ModelInfo,
                              params: SamplingParams) -> tuple[list, list[list[int]]]:
        """`req`'s prompts' token ids as truncate_prompt_tokens keeps them (a text's in its
        tokenizer, which knows the special tokens it added), and the prompts with each cut one
        replaced by its ids (what `echo` shows: what the model saw)."""
        prompts = req.prompts()
        keep = params.kept_tokens(info.max_model_len)
        kept = [params.truncated(p, info.max_model_len) if isinstance(p, list) else p for p in prompts]
        for p in kept:
            if isinstance(p, list):
                check_token_ids(info, p)
        if all(isinstance(p, list) for p in kept):
            ids = kept
        else:
            # prompt tokens that leave room for one more; any length when it is cut
            most = None if keep is not None else info.max_model_len - 1
            truncation = None if keep is None else (keep, params.truncation_side)
            try:
                ids = await call_tokenizer(self.tokenizers, route, "encode_prompts", kept, most,
                                           req.add_special_tokens, truncation)
            except ValueError as err:
                raise OpenAIError(400, error_message(err), "prompt") from None
        if keep is None:
            return prompts, ids
        # a text of `keep` tokens may have been longer: shown as its ids (the model's view)
        return [p if isinstance(p, str) and len(i) < keep else i for p, i in zip(prompts, ids)], ids

    async def _echoes(self, route: ModelRoute, prompts: list, token_ids: list[list[int]]
                      ) -> list[Echo]:
        """What `echo` writes before each prompt's choices: a string prompt as given, token ids
        decoded; with each first token's text, which no logprob entry carries. One decode call
        for all: one hop when the route has a tokenizer deployment."""
        asked = [p for p in prompts if not isinstance(p, str)] + [ids[:1] for ids in token_ids]
        decoded = await call_tokenizer(self.tokenizers, route, "decode", asked)
        texts, firsts = iter(decoded[:-len(token_ids)]), decoded[-len(token_ids):]
        return [Echo(p if isinstance(p, str) else next(texts), ids, first)
                for p, ids, first in zip(prompts, token_ids, firsts)]

    async def _encode_chat(self, route: ModelRoute, req: Any, max_tokens: int | None) -> list[int]:
        """`req`: a ChatPrompt; ValueError for a conversation past `max_tokens` (None: any)."""
        messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
        try:
            return await call_tokenizer(self.tokenizers, route, "encode_chat", messages,
                                        req.chat_options(), max_tokens)
        except ValueError as err:
            raise OpenAIError(400, error_message(err), "messages") from None

    @staticmethod
    def _sampling(req: Any, max_tokens: int | None, logprobs: int | None, info: ModelInfo) -> Any:
        try:
            params = req.sampling_params(max_tokens, logprobs, info.sampling_defaults)
            params.check_vocab(info.vocab_size)
            params.check_context(info.max_model_len)
        except ValueError as err:
            error = request_error(err)
            if error.param == "max_tokens":  # named as the client sent it (chat's max_completion_tokens)
                error.param = req.max_tokens_field
                error.message = error.message.replace("max_tokens", error.param, 1)
            raise error from None
        return params

    async def _start(self, route: ModelRoute, requests: list[EngineRequest]
                     ) -> AsyncIterator[list[tuple[int, EngineChunk]]]:
        """Start one engine stream per prompt; the first batch is fetched before returning so
        that engine-side validation errors become HTTP 400 instead of a broken stream."""
        engine = self.engines[route.module_id]
        gens = [engine.generate(r) for r in requests]
        merged = cancel_on_close(batches(gens), [lambda g=g: engine.cancel(g) for g in gens])
        try:
            first = await merged.__anext__()
        except ValueError as err:
            await merged.aclose()
            raise request_error(err) from None
        except BaseException:
            await merged.aclose()
            raise
        return prepend(first, merged)

    def _tool_output(self, route: ModelRoute, req: Any) -> Any:
        """Makes each choice's ToolOutput; None when the request has no tools (plain text)."""
        mode = req.tool_mode
        if mode == "none":
            return None
        parser = self.tool_parsers[route.module_id]
        return lambda: ToolOutput(mode, parser, req.named_tool, req.parallel_tool_calls)

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; an engine that lives here and died, or the HTTP
        server of this replica, fails it, and Serve restarts the replica."""
        if self.http is not None and self.http.task is not None and not self.http.alive:
            raise RuntimeError(f"the HTTP server on {self.http.host}:{self.http.port} stopped")
        for engine in self.engines.values():
            await engine.check_health()

    # routes (the API key and the body size are checked before them: api.py's middleware)

    async def health(self, _: Request) -> Response:
        try:
            alive = await asyncio.wait_for(
                asyncio.gather(*(e.ping() for e in self.engines.values())), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure is "unhealthy"
            alive = [False]
        return Response(status_code=200 if all(alive) else 503)

    async def version(self, _: Request) -> JSONResponse:
        """vLLM's /version: the server's package version."""
        return JSONResponse({"version": VERSION})

    async def models(self, _: Request) -> JSONResponse:
        data = [await self._model_card(route, name) for route in self.routes for name in route.names]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> JSONResponse:
        """GET /v1/models/{model}: one card (the openai client's models.retrieve)."""
        name = request.path_params["model"]
        return JSONResponse(await self._model_card(self._route(name), name))

    async def _model_card(self, route: ModelRoute, name: str) -> dict[str, Any]:
        info = await self._info(route)
        return {"id": name, "object": "model", "created": 0, "owned_by": "flagserve",
                "root": info.model_path, "parent": None, "max_model_len": info.max_model_len}

    async def metrics(self, _: Request) -> Response:
        text = await self.metrics_hub.render.remote()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        req, route, info = await self._prepare(request, CompletionRequest)
        check_completion(req)
        check_priority(req, info)
        check_n(req, info)
        prompts = req.prompts()
        check_limits(req, self.limits, len(prompts))
        # every value, before tokenizing
        first = self._sampling(req, req.engine_max_tokens, req.logprobs, info)
        prompts, token_ids = await self._encode_prompts(route, req, info, first)
        echoes = await self._echoes(route, prompts, token_ids) if req.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"  # the engine's ids: unique whatever the client sends
        header = Header(req.response_id(rid), req.model or route.names[0])
        requests = []
        asked, cap = req.budget(self.limits.max_tokens, info.sampling_defaults.get("max_tokens"))
        for i, ids in enumerate(token_ids):
            max_tokens = check_budget(info, len(ids), asked, "prompt", cap, req.max_tokens_field)
            params = self._sampling(req, max_tokens, req.logprobs, info)
            requests.append(EngineRequest(f"{rid}-{i}", ids, params, req.stream, time.time(),
                                          req.priority))
        stream = await self._start(route, requests)
        if req.echo_only:
            stream = prompt_only(stream)
        fmt = CompletionFormat(header, req.n, req.logprobs, echoes,
                               token_ids if req.return_token_ids else None)
        if req.stream:
            return sse_response(fmt.stream(stream, req.stream_usage))
        return await whole(fmt, stream)

    async def chat_completions(self, request: Request) -> Response:
        req, route, info = await self._prepare(request, ChatCompletionRequest)
        top = check_chat(req)
        check_priority(req, info)
        check_n(req, info)
        check_limits(req, self.limits)
        # every value, before tokenizing
        first = self._sampling(req, req.requested_max_tokens, top, info)
        # room for one more token; any length when it is cut
        most = None if first.truncate_prompt_tokens is not None else info.max_model_len - 1
        ids = await self._encode_chat(route, req, most)
        ids = first.truncated(ids, info.max_model_len)
        max_tokens = check_budget(info, len(ids), req.requested_max_tokens, "messages",
                                  tightest(self.limits.max_tokens, info.sampling_defaults.get("max_tokens")),
                                  req.max_tokens_field)
        params = self._sampling(req, max_tokens, top, info)
        rid = f"chatcmpl-{uuid.uuid4().hex}"  # the engine's id: unique whatever the client sends
        stream = await self._start(route, [EngineRequest(rid, ids, params, req.stream, time.time(),
                                                         req.priority)])
        header = Header(req.response_id(rid), req.model or route.names[0])
        fmt = ChatFormat(header, req.n, top, self._tool_output(route, req), ids, req.return_token_ids,
                         req.echoed_text)
        if req.stream:
            return sse_response(fmt.stream(stream, req.stream_usage))
        return await whole(fmt, stream)

    # vLLM's tokenizer routes: what the route's tokenizer makes of a text or a conversation,
    # so that a client (lm-eval's remote tokenizer) needs no copy of it. No user modules run:
    # the answer is the tokenizer's view of the input as given.

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_request(tokenize_request(body), body)
        route = self._route(req.model)
        info = await self._info(route)
        if isinstance(req, TokenizeChatRequest):
            # Unbounded, as vLLM's: a count past the context is what a caller trims by.
            ids = await self._encode_chat(route, req, None)
        else:
            ids = await call_tokenizer(self.tokenizers, route, "encode_text", req.prompt,
                                       req.add_special_tokens)
        strs = (await call_tokenizer(self.tokenizers, route, "token_strs", ids)
                if req.return_token_strs else None)
        return await yielding_json({"count": len(ids), "max_model_len": info.max_model_len,
                                    "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await self._body(request)
        req = parse_request(DetokenizeRequest, body)
        route = self._route(req.model)
        try:
            text = await call_tokenizer(self.tokenizers, route, "detokenize", req.tokens)
        except ValueError as err:
            raise OpenAIError(400, error_message(err), "tokens") from None
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> JSONResponse:
        """GET; `?model=` picks the model (the first one without)."""
        unknown = sorted(set(request.query_params) - {"model"})
        if unknown:
            raise OpenAIError(400, unknown_field_message(unknown[0]), unknown[0])
        model = request.query_params.get("model")
        route = self._route(model)
        if route.module_id not in self.tokenizer_infos:  # a tokenizer's config never changes
            self.tokenizer_infos[route.module_id] = await call_tokenizer(self.tokenizers, route, "info")
        # The served context, not the tokenizer file's model_max_length (often a placeholder).
        return JSONResponse({**self.tokenizer_infos[route.module_id],
                             "model_max_length": (await self._info(route)).max_model_len,
                             "model": model or route.names[0]})
