"""The tokenizer as a deployment of its own (`tokenizer.num_replicas >= 1`; default 0: the
ingress tokenizes). When it is worth its round trip per request: README, "The serving graph".

Each method is PromptTokenizer's `<name>_async`: the ingress calls either by the
same name (ingress.call_tokenizer)."""
from __future__ import annotations

from typing import Any

from flagserve.engine.sampling_params import TruncationSide
from flagserve.entrypoints.openai.tokenizer import DEFAULT_CHAT, ChatOptions, PromptTokenizer


class TokenizerDeployment:
    def __init__(self, tokenizer_path: str):
        self.tokenizer = PromptTokenizer(tokenizer_path)

    async def encode_prompts(self, prompts: list[str | list[int]], max_tokens: int | None,
                             add_special_tokens: bool = True,
                             truncation: tuple[int, TruncationSide | None] | None = None
                             ) -> list[list[int]]:
        return await self.tokenizer.encode_prompts_async(prompts, max_tokens, add_special_tokens,
                                                         truncation)

    async def encode_chat(self, messages: list[dict[str, Any]], options: ChatOptions = DEFAULT_CHAT,
                          max_tokens: int | None = None) -> list[int]:
        return await self.tokenizer.encode_chat_async(messages, options, max_tokens)

    async def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.tokenizer.encode_text_async(text, add_special_tokens)

    async def decode(self, prompts: list[list[int]]) -> list[str]:
        return await self.tokenizer.decode_async(prompts)

    async def detokenize(self, ids: list[int]) -> str:
        return await self.tokenizer.detokenize_async(ids)

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self.tokenizer.token_strs_async(ids)

    async def info(self) -> dict[str, Any]:
        return await self.tokenizer.info_async()
