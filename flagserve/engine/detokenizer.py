"""Incremental detokenization and stop-string matching for one sequence.

Decoding a window that starts a few tokens back and keeping only the new suffix gives the
same text as decoding everything (spaces and multi-byte characters that span tokens
included) at a cost independent of the output length.
"""
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers.decoders import ByteLevel
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first outputs, for correct spacing
TAIL_SCAN = 8  # tokens a deferred flush looks back for the last whole character

# tokenizer -> skip_special_tokens -> token id -> its text alone (byte-level tokenizers only)
_pieces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNSEEN = object()  # a token not yet in the cache of single-token texts


def _plain_backend(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether tokenizer.decode is the Rust tokenizer's decode and nothing more."""
    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode  # noqa: SLF001 (no override)
            and not tokenizer.clean_up_tokenization_spaces)


def decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=...), through the Rust tokenizer directly when
    that is all the HF wrapper would do: its Python layers cost more than the decode itself."""
    if _plain_backend(tokenizer):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def piece_cache(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> dict[int, str] | None:
    """The shared cache of single-token texts where text is additive: a byte-level decoder
    turns the tokens' bytes into UTF-8, so once the text so far ends on a whole character, a
    token whose own bytes are whole characters appends exactly its own text. None elsewhere
    (SentencePiece decoders strip or replace by position)."""
    if not (_plain_backend(tokenizer) and isinstance(tokenizer.backend_tokenizer.decoder, ByteLevel)):
        return None
    return _pieces.setdefault(tokenizer, {}).setdefault(skip_special_tokens, {})


@dataclass
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool
    prefix_offset: int
    read_offset: int
    text: str = ""
    # Deferred: append() only counts the tokens and flush() decodes them at once, for a
    # request that reads its text only at the end (FINAL_ONLY, no stop strings).
    deferred: bool = False
    _seen: int = field(default=0, init=False, repr=False)  # tokens deferred up to here
    _decode: Callable[[list[int]], str] = field(init=False, repr=False)
    _pieces: dict[int, str] | None = field(init=False, repr=False)
    _whole: bool = field(default=False, init=False, repr=False)  # the text ends on a whole character

    def __post_init__(self) -> None:
        self._decode = decoder(self.tokenizer, self.skip_special_tokens)
        self._pieces = piece_cache(self.tokenizer, self.skip_special_tokens)

    @classmethod
    def for_prompt(cls, tokenizer: PreTrainedTokenizerBase, num_prompt_tokens: int,
                   skip_special_tokens: bool, deferred: bool = False) -> "IncrementalDetokenizer":
        return cls(tokenizer, skip_special_tokens,
                   max(num_prompt_tokens - CONTEXT_TOKENS, 0), num_prompt_tokens, deferred=deferred)

    def append(self, token_ids: list[int]) -> str:
        """token_ids: the whole sequence, its newest token last. Returns the new text. Two
        decodes of a window, or one dictionary lookup where the token's own text is exact."""
        if self.deferred:
            self._seen = len(token_ids)
            return ""
        delta = None
        if self._whole and self.read_offset == len(token_ids) - 1:
            delta = self._piece(token_ids[-1])
        if delta is None:
            prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(token_ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return ""  # an incomplete UTF-8 character or nothing visible yet: wait for more
            delta = full[len(prefix):]
            self._whole = self._pieces is not None
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta

    def flush(self, token_ids: list[int]) -> None:
        """A deferred detokenizer's text of every token appended so far (token_ids: the whole
        sequence, maybe longer), exactly as appending them one by one leaves it."""
        seen, ids = self._seen, token_ids[:self._seen]
        if seen <= self.read_offset:
            return
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]  # the deltas one by one add up to this
            self.prefix_offset, self.read_offset = self.read_offset, seen
            return
        # An incomplete character at the end: the deltas stopped growing at the last token
        # whose window ends on a whole character. Find it a few tokens back (a character is at
        # most 4 bytes), take the text up to there at once as above, and replay the tokens
        # after it one by one; with no such token near the end, replay them all (rare).
        for end in range(seen - 1, max(self.read_offset, seen - TAIL_SCAN), -1):
            head = self._decode(ids[self.prefix_offset:end])
            if len(head) > len(prefix) and not head.endswith("\ufffd"):
                self.text += head[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, end
                break
        self.deferred = False
        for end in range(self.read_offset + 1, seen + 1):
            self.append(ids[:end])
        self.deferred, self._seen = True, seen

    def _piece(self, token: int) -> str | None:
        """The token's own text where that is exactly what it appends (it follows a whole
        character and is itself whole characters); None: decode the window."""
        piece = self._pieces.get(token, _UNSEEN)
        if piece is _UNSEEN:
            piece = self._decode([token])
            # Cached as None where the token's bytes are not whole characters by themselves.
            piece = self._pieces[token] = piece if piece and "\ufffd" not in piece else None
        return piece


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that the last delta_len characters completed, and where."""
    best: tuple[str, int] | None = None
    for stop in stops:
        # A match must end inside the delta, so it starts at most len(stop)-1 chars before it.
        start = max(len(text) - delta_len - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
