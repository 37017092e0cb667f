"""The tokenizer deployment: chat template and tokenization, scaled apart from the engine.

Prompts reach the engine as token ids. Detokenization stays inside the engine, incremental,
because stop strings must be checked on the text after every step: a separate detokenizer
would put a Ray Serve hop back into the per-token path.
"""
from __future__ import annotations

from typing import Any


class TokenizerDeployment:
    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Completions: strings are encoded with the tokenizer's special tokens (BOS), as vLLM."""
        return [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None) -> list[int]:
        """Raises ValueError when the model has no chat template or the template rejects input."""
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}))
        # The template writes BOS itself where the model wants it.
        return self.tokenizer.encode(text, add_special_tokens=False)
