"""Prompt -> token ids: the chat template and tokenization, as vLLM's OpenAI server does them.

Runs in the ingress replica by default (`tokenizer.num_replicas: 0`), so a request crosses
one Ray Serve hop (ingress -> engine) before its first token; `tokenizer.num_replicas >= 1`
moves it into its own deployment (tokenizer_deployment.py) instead.

Prompts reach the engine as token ids. Detokenization stays inside the engine, incremental,
because stop strings must be checked on the text after every step: a separate detokenizer
would put a Ray Serve hop back into the per-token path.
"""
from __future__ import annotations

from typing import Any


class PromptTokenizer:
    def __init__(self, tokenizer: Any):
        """`tokenizer`: a HF tokenizer's directory, or the tokenizer itself (the benchmark's
        in-process baseline encodes with its engine's, exactly as the server would)."""
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Completions: strings are encoded with the tokenizer's special tokens (BOS), as vLLM."""
        return [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None) -> list[int]:
        """Raises ValueError when the model has no chat template or the template rejects input."""
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}))
        except TemplateError as err:  # e.g. the template's raise_exception() on bad roles
            raise ValueError(f"the chat template rejected the messages: {err}") from None
        # The template writes BOS itself where the model wants it.
        return self.tokenizer.encode(text, add_special_tokens=False)
