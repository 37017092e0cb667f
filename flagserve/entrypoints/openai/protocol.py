"""OpenAI request bodies (plus vLLM's extra sampling fields) and their SamplingParams.

Validation errors become HTTP 400 with the OpenAI error shape. Unknown fields are 400s too,
unlike vLLM, which ignores them with a warning: a field FlagServe cannot honour is never
silently dropped (unhonoured.py lists the OpenAI fields accepted unused and those refused).
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
)

from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.structured_outputs.params import StructuredOutputsParams
from flagserve.entrypoints.openai.checks import tightest
from flagserve.entrypoints.openai.errors import OpenAIError
from flagserve.entrypoints.openai.responses import StreamUsage
from flagserve.entrypoints.openai.structured import ResponseFormat, StructuredOutputsBody, constraint
from flagserve.entrypoints.openai.tokenizer import ChatOptions
from flagserve.entrypoints.openai.tools import (
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    ToolMode,
    tool_constraint,
    tool_mode,
)
from flagserve.entrypoints.openai.unhonoured import ChatRefused, OutputNeutral, Strict, unknown_field_message


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, usage in every event
    include_obfuscation: StrictBool | None = None  # OpenAI's padding of events: none is sent here

    @property
    def usage(self) -> StreamUsage:
        if not self.include_usage:
            return "none"
        return "every" if self.continuous_usage_stats else "last"


# The sampling fields a model's generation_config.json may default (vLLM's list; its
# max_new_tokens caps max_tokens where a request leaves that unset: the ingress's budget).
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")


# Numbers as JSON numbers (an int too), not strings or booleans that lax parsing would take.
class _Request(OutputNeutral):
    model: str | None = None  # None: the only (or first) served model
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # checks.check_stream: only with stream
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Constraints on the output (structured.py): OpenAI's, or vLLM's field
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's: per prompt token, its logprob and the top-N alternatives (scoring, lm-eval)
    prompt_logprobs: StrictInt | None = None
    # vLLM's: sample only among these ids; never these words; keep this many prompt tokens
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the response's id is <cmpl or chatcmpl>-<request_id>; the engine's ids stay unique
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: lower is scheduled earlier, where the engine's scheduling_policy is "priority"
    # (checks.check_priority); under first come, first served only 0, as vLLM's
    priority: StrictInt = 0
    # vLLM's: the prompt's and each choice's token ids in the response (RL frameworks read them)
    return_token_ids: StrictBool = False

    def response_id(self, engine_id: str) -> str:
        """The client's request_id under the engine id's prefix (cmpl, chatcmpl), else that id."""
        if self.request_id is None:
            return engine_id
        return f"{engine_id.split('-', 1)[0]}-{self.request_id}"

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: what the engine must score of the prompt."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError naming the SamplingParams field when a value is out of range.
        `defaults`: the model's (generation_config.json) for the sampling fields not sent."""
        sent = {k: getattr(self, k) for k in DEFAULTED if getattr(self, k) is not None
                and k in self.model_fields_set}
        chosen = {**{k: v for k, v in (defaults or {}).items() if k in DEFAULTED}, **sent}
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.engine_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.output_constraint(), logit_bias=token_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side,
            **chosen)

    def output_constraint(self) -> StructuredOutputsParams | None:
        return constraint(self.response_format, self.structured_outputs)

    @property
    def stream_usage(self) -> StreamUsage:
        return self.stream_options.usage if self.stream_options is not None else "none"


TOKEN_ID = re.compile(r"-?[0-9]+")


def token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings; {} asks for nothing."""
    if not bias:
        return None
    bad = [token for token in bias if not TOKEN_ID.fullmatch(token)]  # int() takes " 1_0 " too
    if bad:
        raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers, as "
                         f"strings in JSON), got {bad[:5]}")
    return {int(token): value for token, value in bias.items()}


Prompt = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class CompletionRequest(_Request):
    prompt: Prompt
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None  # top-N alternatives per token (OpenAI allows 0..5)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True  # vLLM's: false encodes a string prompt without BOS

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt alone (OpenAI's and vLLM's scoring request)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int | None:
        """What the engine generates: one token for an echo_only request (dropped from the
        response: the engine samples at least one), else max_tokens."""
        return 1 if self.echo_only else self.max_tokens

    def budget(self, cap: int | None, model_default: int | None = None
               ) -> tuple[int | None, int | None]:
        """check_budget's (max_tokens, cap): the default of 16, not sent, is a cap on what
        the context leaves rather than a request for 16 (vLLM's), so a prompt cut to fit
        (truncate_prompt_tokens: -1) is served; `max_tokens: null` is capped by the model's
        generation_config.json max_new_tokens (`model_default`), as vLLM's."""
        if "max_tokens" not in self.model_fields_set:
            return None, min(self.max_tokens, cap or self.max_tokens)
        asked = self.engine_max_tokens
        return asked, cap if asked is not None else tightest(cap, model_default)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """vLLM's rule: echo with logprobs scores the echoed prompt as deeply as the output,
        unless prompt_logprobs says otherwise."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        kinds = {p.get("type") for p in value if isinstance(p, dict)} if isinstance(value, list) else ()
        other = sorted(str(k) for k in kinds if k != "text")
        if other:
            raise ValueError(f"content parts of type {other[0]!r} are not supported: this server "
                             "takes text (a string, or parts of type 'text')")
        return value


# chat_template_kwargs become the template's variables; these would instead be arguments of
# apply_chat_template itself: `chat_template` a template of the caller's (code run on the
# replica), `tokenize` or `conversation` a clash with the server's own arguments.
TEMPLATE_CALL_ARGS = frozenset({"chat_template", "conversation", "tokenize", "add_generation_prompt",
                                "tools", "documents", "return_dict", "tokenizer_kwargs"})


class ChatPrompt(Strict):
    """What the chat template renders: chat completions' prompt, and /tokenize's `messages` form."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: the last message left open (a prefill)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    # vLLM's: the tokenizer's special tokens on top of the template's (which writes BOS itself)
    add_special_tokens: StrictBool = False

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value: bool, info: Any) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                             "set add_generation_prompt to false to continue the last message")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & TEMPLATE_CALL_ARGS)
        if taken:
            raise ValueError(f"{taken[0]!r} is an argument of the template call, not a template "
                             "variable; set the request's own field instead where there is one")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a call names its function: two of one name could not be told apart
            raise ValueError(f"two functions are named {twice[0]!r}")
        return tools

    @property
    def tool_mode(self) -> ToolMode:
        """OpenAI's default: auto with tools, else none."""
        return tool_mode(self.tools, None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template sees: the tools, but for tool_choice none."""
        if not self.tools or self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_variables(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})

    def chat_options(self) -> ChatOptions:
        """How the conversation is rendered. Only `auto` needs the model to know the tools'
        format; required and named calls are written by the grammar, and the description
        would cost a blind template's context."""
        tools = self.template_tools()
        variables = {**self.template_variables(), **({"tools": tools} if tools else {})}
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, variables or None,
                           self.tool_mode == "auto", self.add_special_tokens)


class ChatCompletionRequest(ChatRefused, _Request, ChatPrompt):
    max_tokens: StrictInt | None = None  # None: up to the context window
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tool_choice: ToolChoice | None = None  # None: auto with tools, else none (OpenAI's default)
    parallel_tool_calls: StrictBool = True  # False: `required` makes exactly one call
    # a template variable, as vLLM passes it (with enable_thinking unless the caller sets it)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: the answer starts with the last message's text where that is the assistant's
    # (a prefill continued with continue_final_message comes back whole)
    echo: StrictBool = False

    @property
    def echoed_text(self) -> str:
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or not last.content:
            return ""
        return last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content)

    def template_variables(self) -> dict[str, Any]:
        variables = super().template_variables()
        if self.reasoning_effort is not None:
            variables = {"reasoning_effort": self.reasoning_effort,
                         "enable_thinking": self.reasoning_effort != "none", **variables}
        return variables

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def tool_mode(self) -> ToolMode:
        """Raises ValueError naming tool_choice (sampling_params() checks it first)."""
        try:
            return tool_mode(self.tools, self.tool_choice)
        except ValueError as err:
            raise ValueError(f"SamplingParams.{err}") from None

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """A tool_choice of `required` or a function constrains the output (tools.py)."""
        tools = tool_constraint(self.tools, self.tool_mode, self.named_tool, self.parallel_tool_calls)
        other = super().output_constraint()
        if tools is not None and other is not None:
            raise ValueError("SamplingParams.tool_choice that forces a call (required, a named "
                             "function) cannot be combined with response_format or structured_outputs")
        return tools or other


# vLLM's tokenizer routes (/tokenize, /detokenize): the shapes of its serving_tokenization.

class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # as /v1/completions encodes a string prompt
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatPrompt):
    """The tokens /v1/chat/completions would give the model for these messages."""

    model: str | None = None
    return_token_strs: StrictBool = False


def tokenize_request(body: dict[str, Any]) -> type[BaseModel]:
    """vLLM's two forms of /tokenize, told apart by `messages`; a body with both `messages` and
    `prompt` is then refused for the unknown field."""
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[StrictInt]


def parse_request(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """The request, or a 400 naming the first field that is wrong (or unknown)."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        # Of a field's errors, the deepest: where a union's members all fail (tool_choice's
        # string or object), the member that got furthest says what is wrong.
        first = max(err.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(p) for p in first["loc"] if not _union_member(p))
        message = (unknown_field_message(where) if first["type"] == "extra_forbidden"
                   else f"{where}: {first['msg']}")
        raise OpenAIError(400, message, str(first["loc"][0])) from None


def _union_member(part: Any) -> bool:
    """Whether a step of an error's location names a union's member, not a field: pydantic's
    tags `str`, `list[TextPart]`, `literal['auto',...]`, `NamedToolChoice` (fields are snake_case)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list")
                                      or "[" in part or part[:1].isupper())
