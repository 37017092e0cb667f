"""Structured outputs against random constraints: every output of a random JSON schema, regex
or choice list is valid (hypothesis, the tiny model); and the mask never disturbs an allowed
token: greedy under a constraint that admits the unconstrained output gives the same tokens
(the tiny model, and SmolLM2 for real text)."""
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagserve import LLM, SamplingParams, StructuredOutputsParams

NAMES = st.sampled_from(["a", "b", "id", "name", "tags", "x_y"])
WORDS = st.text("abcxyz ", min_size=1, max_size=5)


def _leaf() -> st.SearchStrategy:
    bounded = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": lo_span[0] + lo_span[1]})
    return st.one_of(bounded, st.just({"type": "boolean"}),
                     st.lists(WORDS, min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
                     st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}))


def _array(items: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def _object(values: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, required: list[bool]) -> dict:
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required) if r]}
    return st.dictionaries(NAMES, values, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props))
        .map(lambda req: build(props, req)))


# Nested objects and arrays, two levels deep: enough structure, and short outputs.
SCHEMAS = _object(st.recursive(_leaf(), lambda inner: st.one_of(_array(inner), _object(inner)),
                               max_leaves=4))
PIECES = st.sampled_from([r"[a-c]{1,3}", r"\d{2}", "x", r"(ab|cd)", r"[0-9a-f]?", r"-", r"z+?"])
REGEXES = st.lists(PIECES, min_size=1, max_size=4).map("".join)
CHOICES = st.lists(st.text("abc XYZ-!", min_size=1, max_size=8), min_size=1, max_size=4, unique=True)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


def run(llm: LLM, temperature: float = 1.0, max_tokens: int = 200, prompt: str = "Things:", **kind):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**kind))
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


@SETTINGS
@given(schema=SCHEMAS)
def test_random_schemas_give_valid_json(llm, schema):
    c = run(llm, json=schema)
    assert c.finish_reason == "stop", (schema, c.text)
    jsonschema.validate(json.loads(c.text), schema)


@SETTINGS
@given(regex=REGEXES)
def test_random_regexes_match(llm, regex):
    c = run(llm, regex=regex)
    assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), (regex, c.text)


@SETTINGS
@given(choices=CHOICES)
def test_random_choices_are_one_of_them(llm, choices):
    c = run(llm, choice=choices)
    assert c.text in choices, (choices, c.text)


def _escape(text: str) -> str:
    """A regex for exactly `text`: every non-alphanumeric character as a one-character class
    (xgrammar's regex dialect is not Python's; `[ ]` and `[\\.]` mean the same in both)."""
    controls = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}  # a class may not hold a raw newline
    return "".join(ch if ch.isalnum() else controls.get(ch) or
                   "[" + ("\\" + ch if ch in "\\]^-[" else ch) + "]" for ch in text)


def assert_mask_keeps_greedy(llm: LLM, prompts: list[str], max_tokens: int) -> None:
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    checked = 0
    for prompt, out in zip(prompts, free):
        c = out.outputs[0]
        if "\ufffd" in c.text or not c.text:  # a split UTF-8 character: no text to admit
            continue
        for kind in ({"choice": [c.text]}, {"regex": _escape(c.text)}):
            got = run(llm, 0.0, max_tokens + 1, prompt, **kind)
            assert got.text == c.text and got.token_ids[:len(c.token_ids)] == c.token_ids, (kind, prompt)
        checked += 1
    assert checked >= len(prompts) // 2  # the comparison ran on most prompts


def test_a_constraint_admitting_the_greedy_output_keeps_its_tokens(llm):
    assert_mask_keeps_greedy(llm, ["The weather today is", "We cook rice with", "Count to 42 and",
                                   "Hello"], 10)


def test_smollm2_keeps_its_greedy_tokens_and_follows_a_schema():
    from flagserve.models.packaged import smollm2_gguf
    llm = LLM(str(smollm2_gguf()), max_model_len=512)
    assert_mask_keeps_greedy(llm, ["The capital of France is", "def add(a, b):"], 12)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    c = run(llm, 0.0, 150, "The largest city of Japan as JSON:", json=schema)
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema)


def test_length_bounded_strings_admit_no_raw_control_character():
    """Found by test_random_schemas_give_valid_json: xgrammar's maxLength rule let a raw tab in."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from flagserve.engine.structured_outputs.params import parse_grammar
    grammar = parse_grammar("json", json.dumps({"type": "string", "minLength": 1, "maxLength": 3}))
    assert accepts(grammar, '"a b"') and accepts(grammar, '"\u00e9"')
    assert not any(accepts(grammar, f'"a{ch}"') for ch in "\t\x00\x1f\n")
