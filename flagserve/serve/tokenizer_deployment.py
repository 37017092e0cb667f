"""The tokenizer as a deployment of its own (`tokenizer.num_replicas >= 1`; default 0: the
ingress tokenizes). Worth it only when tokenization is heavy enough to stall the ingress's
event loop, which also writes every SSE stream: very long prompts or an expensive chat
template. It costs one Ray Serve round trip per request (about 1.5 ms on an idle 2-core CPU
machine, more under load)."""
from __future__ import annotations

from typing import Any

from flagserve.entrypoints.openai.tokenizer import PromptTokenizer


class TokenizerDeployment:
    def __init__(self, tokenizer_path: str):
        self.tokenizer = PromptTokenizer(tokenizer_path)

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return self.tokenizer.encode_prompts(prompts)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt, template_kwargs)
