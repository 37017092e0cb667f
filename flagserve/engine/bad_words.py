"""SamplingParams.bad_words as vLLM enforces them: token sequences whose last token is banned
wherever the tokens before it end the output so far (a word of one token: always).

A word is tokenized as written and with a leading space, because most tokenizers spell a
word mid-text with its space in the first token; the spaced form is kept only where it is a
different token sequence of the same length (vLLM's rule: a longer one would split the
word differently and ban pieces of other words).
"""
from transformers import PreTrainedTokenizerBase

from flagserve.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str],
                        vocab_size: int) -> list[list[int]]:
    """ValueError for a word that tokenizes to nothing or past the model's logits, or for more
    sequences or tokens than the bounds above (each is checked at every step of the request)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            _refuse(f"entries must tokenize to at least one token, got {word!r}")
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    total = sum(map(len, sequences))
    if len(sequences) > MAX_BAD_WORDS or total > MAX_BAD_WORD_TOKENS:
        _refuse(f"tokenize to {len(sequences)} token sequences of {total} tokens in all; at most "
                f"{MAX_BAD_WORDS} sequences and {MAX_BAD_WORD_TOKENS} tokens are allowed")
    past = [t for seq in sequences for t in seq if t >= vocab_size]
    if past:  # a tokenizer's added tokens past the model's logits
        _refuse(f"tokenize to ids past the vocabulary size {vocab_size}: {past[:5]}")
    return sequences


def _refuse(message: str) -> None:
    raise ValueError(f"SamplingParams.bad_words {message}")


def banned_now(sequences: list[list[int]], output_token_ids: list[int] | None) -> list[int]:
    """The tokens that would complete a bad word after `output_token_ids` (None: the sampler
    was not sent the output, which only happens when every word is one token)."""
    banned = []
    for seq in sequences:
        *head, last = seq
        if not head or output_token_ids is not None and len(output_token_ids) >= len(head) \
                and output_token_ids[-len(head):] == head:
            banned.append(last)
    return banned
