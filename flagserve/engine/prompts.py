"""vLLM's prompt dicts: a TextPrompt {"prompt": text} or a TokensPrompt {"prompt_token_ids":
ids}, whose optional "prompt" is the ids' text, kept for the outputs. Keys for inputs this
engine does not take (multi-modal data, a cache salt) pass only when they are None."""


def prompt_fields(prompt: dict) -> tuple[str | None, list[int] | None]:
    """(text, token ids): the ids where given, else the text to tokenize."""
    extra = sorted(k for k, v in prompt.items() if k not in ("prompt", "prompt_token_ids")
                   and v is not None)
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if extra or (ids is None and not isinstance(text, str)) or not isinstance(text, str | None):
        raise ValueError(f"a dict prompt takes 'prompt' (text) or 'prompt_token_ids' (with "
                         f"'prompt' as their text), got {sorted(prompt)}")
    return text, ids
