"""Incremental detokenization against the tokenizer's own decode of everything at once."""
import random

import pytest

from flagserve.engine.detokenizer import IncrementalDetokenizer, decoder, find_stop_string
from flagserve.models.tokenizer import load_tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=ARCHS + ["smollm2"])
def tokenizer(request, tiny_model_factory):
    if request.param != "smollm2":
        return load_tokenizer(tiny_model_factory(request.param))
    from flagserve.models.packaged import smollm2_gguf
    try:
        return load_tokenizer(smollm2_gguf())
    except FileNotFoundError as err:
        pytest.skip(str(err))


def random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    # Every id, special ones included: byte tokens make multi-byte characters span tokens.
    return [rng.randrange(len(tokenizer)) for _ in range(n)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoder_is_the_tokenizers_decode(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    decode = decoder(tokenizer, skip_special_tokens)
    for n in (0, 1, 2, 7, 40):
        for _ in range(20):
            ids = random_ids(tokenizer, rng, n)
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def trials(tokenizer, seed: int, n: int, text: str):
    """(prompt, output) pairs: random prompts; outputs alternately a prefix of `text`'s tokens
    (multi-byte characters split across tokens) and random ids."""
    rng = random.Random(seed)
    natural = tokenizer.encode(text, add_special_tokens=False)
    for trial in range(n):
        prompt = random_ids(tokenizer, rng, rng.randrange(1, 12))
        yield prompt, (natural[:rng.randrange(1, len(natural))] if trial % 2
                       else random_ids(tokenizer, rng, 30))


def test_deltas_add_up_to_the_whole_decode(tokenizer):
    # The text streamed token by token is the decode of all output tokens (given the prompt),
    # once no incomplete character is left at the end.
    text = "caf\u00e9 \u4f60\u597d, na\u00efve \U0001f600 r\u00e9sum\u00e9 " * 3
    for prompt, out in trials(tokenizer, 1, 30, text):
        detok = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt), skip_special_tokens=True)
        ids = list(prompt)
        for token in out:
            ids.append(token)
            detok.append(ids)
        whole = tokenizer.decode(prompt + out, skip_special_tokens=True)
        head = tokenizer.decode(prompt, skip_special_tokens=True)
        if not whole.endswith("\ufffd"):
            assert head + detok.text == whole


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_single_token_texts_give_the_window_decodes_deltas(tokenizer, skip_special_tokens):
    """Where the tokenizer is byte-level, a token after a whole character appends its own
    cached text: every delta must equal the one the two window decodes give."""
    from flagserve.engine.detokenizer import piece_cache

    assert piece_cache(tokenizer, skip_special_tokens) is not None  # all of ours are byte-level
    text = "caf\u00e9 \u4f60\u597d, na\u00efve \U0001f600 r\u00e9sum\u00e9 <|im_end|> " * 3
    for prompt, out in trials(tokenizer, 2, 40, text):
        fast = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt), skip_special_tokens)
        slow = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt), skip_special_tokens)
        slow._pieces = None  # noqa: SLF001 - the window decodes only
        ids = list(prompt)
        for token in out:
            ids.append(token)
            assert fast.append(ids) == slow.append(ids), (prompt, ids)
        assert fast.text == slow.text
    assert piece_cache(tokenizer, skip_special_tokens)  # the cached path ran


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deferred_text_is_the_token_by_token_text(tokenizer, skip_special_tokens):
    """A deferred detokenizer decodes once at the end (flush) to the same text as the deltas,
    also where the output ends inside a character (the deltas hold part of it back) and when
    the last tokens were never appended (an EOS)."""
    text = "caf\u00e9 \u4f60\u597d, na\u00efve \U0001f600 r\u00e9sum\u00e9 " * 3
    for prompt, out in trials(tokenizer, 3, 40, text):
        each = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt), skip_special_tokens)
        once = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt), skip_special_tokens, deferred=True)
        ids = list(prompt)
        for token in out:
            ids.append(token)
            each.append(ids)
            assert once.append(ids) == "" and once.text == ""
        once.flush(ids + [0, 0])  # tokens after the last append are not its
        assert once.text == each.text, (prompt, out)
        once.flush(ids)  # nothing new: no change
        assert once.text == each.text


def test_find_stop_string_earliest_match_ending_in_the_delta():
    assert find_stop_string("abcSTOPdef", 3, ["STOP"]) is None  # ended before the delta
    assert find_stop_string("abcSTOPdef", 5, ["STOP", "def"]) == ("STOP", 3)
    assert find_stop_string("xxENDyy", 4, ["yy", "END"]) == ("END", 2)


def test_a_long_output_ending_inside_a_character_replays_only_its_tail(tokenizer):
    """The deferred flush finds the last whole character a few tokens back instead of
    replaying every token: a 400-token output cut inside its last character replays at most
    TAIL_SCAN tokens (and still equals the deltas)."""
    from flagserve.engine.detokenizer import TAIL_SCAN

    natural = tokenizer.encode("plain words " * 100 + "\U0001f600\U0001f601", add_special_tokens=False)
    cuts = [n for n in range(len(natural) - 8, len(natural))
            if tokenizer.decode(natural[:n]).endswith("\ufffd")]
    if not cuts:
        pytest.skip("this tokenizer keeps the emoji whole")
    for cut in cuts:
        ids = [5, 6, 7] + natural[:cut]  # a 3-token prompt, then the output
        each = IncrementalDetokenizer.for_prompt(tokenizer, 3, True)
        for end in range(4, len(ids) + 1):
            each.append(ids[:end])
        once = IncrementalDetokenizer.for_prompt(tokenizer, 3, True, deferred=True)
        once.append(ids)
        replayed = []

        def counted(token_ids, real=once.append, replayed=replayed):
            replayed.append(len(token_ids))
            return real(token_ids)
        once.append = counted
        once.flush(ids)
        assert once.text == each.text and len(replayed) <= TAIL_SCAN, (cut, len(replayed))
