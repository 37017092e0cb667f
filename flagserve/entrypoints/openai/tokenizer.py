"""Prompt -> token ids: the chat template and tokenization, as vLLM's OpenAI server does them.

Runs in the ingress replica by default (`tokenizer.num_replicas: 0`), so a request crosses
one Ray Serve hop (ingress -> engine) before its first token; `tokenizer.num_replicas >= 1`
moves it into its own deployment (tokenizer_deployment.py) instead.

Prompts reach the engine as token ids. Detokenization stays inside the engine, incremental,
because stop strings must be checked on the text after every step: a separate detokenizer
would put a Ray Serve hop back into the per-token path.

Long inputs cost: tokenizing takes about 0.5 s per MB of text and shares the event loop
that writes every SSE stream and answers /health. So a text that cannot fit the context is
refused from its length alone, before it is tokenized (`max_chars`), and a large input that
may fit is tokenized on a thread of its own (the tokenizer releases the GIL while it works).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flagserve.engine.sampling_params import TruncationSide, cut_tokens
from flagserve.entrypoints.openai.template_input import joined_text, with_tools_in_system
from flagserve.models.tokenizer import load_tokenizer, special_edges

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
PROBE_TOOL = {"type": "function", "function": {"name": "flagserve_probe_tool", "parameters": {}}}
PROBE_TEXT = "flagserve probe text"


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's request fields of the same names)."""
    add_generation_prompt: bool = True
    # the last message left open for the model to go on with (an assistant prefill)
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None  # the template's variables, `tools` among them
    # a template that does not show the `tools` gets them in the system message (tools.py)
    describe_tools: bool = False
    # the tokenizer's own special tokens on top; by default none: the template writes BOS
    # itself where the model wants it
    add_special_tokens: bool = False


DEFAULT_CHAT = ChatOptions()


class PromptTokenizer:
    def __init__(self, tokenizer: Any):
        """`tokenizer`: a HF tokenizer's directory or a .gguf file, or the tokenizer itself (the
        benchmark's in-process baseline encodes with its engine's, exactly as the server would)."""
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.chars_per_token = max_chars_per_token(tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # started on first use
        self._template_shows_tools: bool | None = None  # probed on the first request with tools
        self._template_takes_parts: bool | None = None  # probed on the first message with parts

    def check_length(self, text: str, max_tokens: int | None) -> None:
        """Refuse, untokenized, a text too long to be `max_tokens` tokens or fewer (None: any)."""
        if max_tokens is not None and len(text) > max_tokens * self.chars_per_token:
            raise ValueError(f"the prompt has {len(text)} characters: more than {max_tokens} tokens "
                             f"(at most {self.chars_per_token} characters each), which is all "
                             "this model's context leaves for the prompt")

    def encode_prompts(self, prompts: list[str | list[int]], max_tokens: int | None = None,
                       add_special_tokens: bool = True,
                       truncation: tuple[int, TruncationSide | None] | None = None) -> list[list[int]]:
        """Completions: strings are encoded with the tokenizer's special tokens (BOS) unless
        `add_special_tokens` is false, as vLLM, and cut to `truncation`'s (kept tokens, side)
        (cut_tokens: with no side its special tokens stay). ValueError for a string that cannot
        be `max_tokens` tokens or fewer."""
        for p in prompts:
            if isinstance(p, str):
                self.check_length(p, max_tokens)
        encoded = [p if isinstance(p, list) else self.encode_text(p, add_special_tokens) for p in prompts]
        if truncation is None:
            return encoded
        edges = special_edges(self.tokenizer) if add_special_tokens else (0, 0)
        return [ids if isinstance(p, list) else cut_tokens(ids, *truncation, edges)
                for p, ids in zip(prompts, encoded)]

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Unbounded: /tokenize counts a text whatever its length (lm-eval truncates after)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], options: ChatOptions = DEFAULT_CHAT,
                    max_tokens: int | None = None) -> list[int]:
        """Raises ValueError when the model has no chat template, the template rejects input,
        or the conversation cannot be `max_tokens` tokens or fewer."""
        return self.render_chat(messages, options, max_tokens)[1]

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions = DEFAULT_CHAT,
                    max_tokens: int | None = None) -> tuple[str, list[int]]:
        """encode_chat's token ids, with the text the template rendered."""
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        parts = any(isinstance(m.get("content"), list) for m in messages)
        if parts and not self.template_takes_parts():
            messages = [joined_text(m) for m in messages]
        template_kwargs = options.template_kwargs or {}
        tools = template_kwargs.get("tools")
        if tools and options.describe_tools and not self.template_shows_tools():
            template_kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}
            messages = with_tools_in_system(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **template_kwargs)
        except Exception as err:  # noqa: BLE001 - the template is code run on the caller's input
            # (its raise_exception() on bad roles, a TypeError on a field of the wrong type)
            raise ValueError(f"the chat template rejected the messages: {err}") from None
        self.check_length(text, max_tokens)
        return text, self.encode_text(text, options.add_special_tokens)

    def decode(self, prompts: list[list[int]]) -> list[str]:
        """Token-id prompts' text, special tokens kept (vLLM's, for `echo`)."""
        return self.tokenizer.batch_decode(prompts)

    def detokenize(self, ids: list[int]) -> str:
        """/detokenize: ValueError for an id outside the vocabulary, which the tokenizer would
        drop without a word (and a negative one would fail in its Rust core)."""
        size = len(self.tokenizer)  # with the added tokens
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {size})")
        return self.decode([ids])[0]

    def token_strs(self, ids: list[int]) -> list[str]:
        """vLLM's `return_token_strs`: each token as the vocabulary spells it (byte-level BPE's
        "Ġ" for a space), not its decoded text."""
        return self.tokenizer.convert_ids_to_tokens(ids)

    def info(self) -> dict[str, Any]:
        """/tokenizer_info's part from the tokenizer: what a client needs to tokenize as the
        server does (lm-eval's remote tokenizer reads the special tokens and the template)."""
        special = self.tokenizer.special_tokens_map  # named tokens that are set, as strings
        return {"tokenizer_class": type(self.tokenizer).__name__,
                **{name: special.get(name) for name in SPECIAL_TOKENS},
                "chat_template": self.tokenizer.chat_template}

    def template_takes_parts(self) -> bool:
        """Whether the chat template renders content given as text parts as it renders the
        same text given as a string (many concatenate `content` and fail on a list)."""
        if self._template_takes_parts is None:
            def render(content: Any) -> str | None:
                try:
                    return self.tokenizer.apply_chat_template(
                        [{"role": "user", "content": content}], tokenize=False)
                except Exception:  # noqa: BLE001 - a template that fails on parts does not take them
                    return None
            as_text = render(PROBE_TEXT)
            self._template_takes_parts = (as_text is not None and
                                          render([{"type": "text", "text": PROBE_TEXT}]) == as_text)
        return self._template_takes_parts

    def template_shows_tools(self) -> bool:
        """Whether the chat template writes the `tools` it is given into the prompt."""
        if self._template_shows_tools is None:
            try:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}], tokenize=False, tools=[PROBE_TOOL])
            except Exception:  # noqa: BLE001 - a template that fails on tools does not show them
                text = ""
            self._template_shows_tools = PROBE_TOOL["function"]["name"] in text
        return self._template_shows_tools

    async def encode_prompts_async(self, prompts: list[str | list[int]], max_tokens: int | None,
                                   add_special_tokens: bool = True,
                                   truncation: tuple[int, TruncationSide | None] | None = None
                                   ) -> list[list[int]]:
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await self._run(size, self.encode_prompts, prompts, max_tokens, add_special_tokens,
                               truncation)

    async def encode_chat_async(self, messages: list[dict[str, Any]], options: ChatOptions = DEFAULT_CHAT,
                                max_tokens: int | None = None) -> list[int]:
        # Content given as parts counts as large: measuring it would cost what it saves. Each
        # message costs the template some work of its own (its role's markup, a loop turn).
        size = sum(max(len(c), 64) if isinstance(c := m.get("content"), str) else INLINE_CHARS
                   for m in messages)
        return await self._run(size, self.encode_chat, messages, options, max_tokens)

    async def encode_text_async(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(len(text), self.encode_text, text, add_special_tokens)

    async def decode_async(self, prompts: list[list[int]]) -> list[str]:
        # Sized by tokens: decoding one costs less than encoding the characters it stands for.
        return await self._run(sum(map(len, prompts)), self.decode, prompts)

    async def detokenize_async(self, ids: list[int]) -> str:
        return await self._run(len(ids), self.detokenize, ids)

    async def token_strs_async(self, ids: list[int]) -> list[str]:
        return await self._run(len(ids), self.token_strs, ids)

    async def info_async(self) -> dict[str, Any]:
        return self.info()  # a few attributes: inline

    async def _run(self, size: int, work: Any, *args: Any) -> Any:
        if size <= INLINE_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)


# Inputs up to this many characters are tokenized on the event loop: about 2 ms of work, where
# the hop to the thread and back would cost more than the stall it saves.
INLINE_CHARS = 4096


def max_chars_per_token(tokenizer: Any) -> int:
    """A bound on the characters of text one token stands for: its longest vocabulary entry
    (byte-level BPE writes one character per byte; SentencePiece one per character, longer for
    byte fallback <0x..>), times 4 when a normalizer may compose characters (NFC makes one of
    up to four). Text longer than max_tokens times this cannot be max_tokens tokens."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (4 if getattr(backend, "normalizer", None) is not None else 1)
