"""Completions' `echo` and vLLM's `prompt_logprobs` in the response formats, from hand-made
engine chunks (no engine, no server): the echoed text, the logprob lists that start with the
prompt's tokens, `prompt_logprobs` in vLLM's shape, streamed and not; the request fields,
their checks and what the engine is asked for; decoding token-id prompts; and a refusal of
the disaggregated engine reaching the client as a 400.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from flagserve.engine.outputs import CompletionOutput, Logprob
from flagserve.entrypoints.openai.checks import check_chat, check_completion
from flagserve.entrypoints.openai.engine_client import EngineChunk, EngineRequest, ModelInfo
from flagserve.entrypoints.openai.errors import OpenAIError
from flagserve.entrypoints.openai.ingress import OpenAIIngress
from flagserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from flagserve.entrypoints.openai.responses import ChatFormat, CompletionFormat, Echo, Header
from flagserve.entrypoints.openai.streams import batches
from flagserve.entrypoints.openai.tokenizer import PromptTokenizer
from flagserve.serve.disagg_client import DisaggregatedEngine
from flagserve.serve.tokenizer_deployment import TokenizerDeployment

# The ingress's methods alone, run on stand-ins for the ingress (no engine, no server)
ECHOES = OpenAIIngress._echoes  # noqa: SLF001
START = OpenAIIngress._start  # noqa: SLF001

# The prompt [0, 10, 11] ("<s>Hello"), scored with 2 alternatives per token: "Hel" was the
# model's third choice, "lo" its first (one entry: the token is among the top ones).
ECHO = Echo("<s>Hello", [0, 10, 11], "<s>")
PROMPT_LPS = [None,
              {10: Logprob(-2.0, 3, "Hel"), 20: Logprob(-0.5, 1, "A"), 21: Logprob(-1.0, 2, "B")},
              {11: Logprob(-0.1, 1, "lo"), 22: Logprob(-2.5, 2, "C")}]
OUT_1 = CompletionOutput(0, " wor", [30], None, [{30: Logprob(-0.3, 1, " wor")}])
OUT_2 = CompletionOutput(0, "ld", [31], None, [{31: Logprob(-0.7, 2, "ld"), 32: Logprob(-0.2, 1, "X")}],
                         "length")


def chunk(*outs: CompletionOutput, prompt_logprobs=None, finished=False) -> EngineChunk:
    return EngineChunk(list(outs), len(ECHO.token_ids), 0, finished, prompt_logprobs)


def merged(index: int = 0) -> CompletionOutput:
    """OUT_1 and OUT_2 as the one chunk of a non-streamed request (choice `index`)."""
    return CompletionOutput(index, OUT_1.text + OUT_2.text, OUT_1.token_ids + OUT_2.token_ids, None,
                            OUT_1.logprobs + OUT_2.logprobs, "length")


async def stream(*chunks, pause: bool = False):
    for c in chunks:
        if pause:
            await asyncio.sleep(0.01)  # one batch per chunk
        yield c


def events(sse_texts: list[str]) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in sse_texts if e.startswith("data: {")]


async def full(fmt, *streams):
    return await fmt.full(batches(list(streams)))


async def streamed(fmt, *streams):
    return events([e async for e in fmt.stream(batches(list(streams)), usage="none")])


def lm_eval_reading(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions takes of a choice for loglikelihood: the
    summed logprobs of the continuation (the prompt past ctxlen, less the generated token),
    and whether each was the top alternative."""
    logprobs = choice["logprobs"]
    scored = logprobs["token_logprobs"][ctxlen:-1]
    tops = logprobs["top_logprobs"][ctxlen:-1]
    return sum(scored), all(lp == max(top.values()) for lp, top in zip(scored, tops))


# Formats

def test_echo_prefixes_text_and_logprobs_with_the_prompt():
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=1, echoes=[ECHO])
    body = asyncio.run(full(fmt, stream(chunk(merged(), prompt_logprobs=PROMPT_LPS, finished=True))))
    (choice,) = body["choices"]
    assert choice["text"] == "<s>Hello world"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["<s>", "Hel", "lo", " wor", "ld"]
    assert lps["token_logprobs"] == [None, -2.0, -0.1, -0.3, -0.7]
    # top-1 by rank (the prompt was scored with 2, the request asks for 1), and the token
    # itself where it is not that one (OpenAI's: up to logprobs + 1 entries)
    assert lps["top_logprobs"] == [None, {"A": -0.5, "Hel": -2.0}, {"lo": -0.1}, {" wor": -0.3},
                                   {"X": -0.2, "ld": -0.7}]
    assert lps["text_offset"] == [0, 3, 6, 8, 12]
    for token, offset in zip(lps["tokens"], lps["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token


def test_offsets_keep_rising_past_a_bos_the_text_lacks():
    """A string prompt is echoed as given, without the BOS the tokenizer put first: the
    output's offsets go on from the prompt tokens' (vLLM's), never back."""
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=1, echoes=[Echo("Hello", [0, 10, 11], "<s>")])
    body = asyncio.run(full(fmt, stream(chunk(merged(), prompt_logprobs=PROMPT_LPS, finished=True))))
    (choice,) = body["choices"]
    assert choice["text"] == "Hello world"
    assert choice["logprobs"]["text_offset"] == [0, 3, 6, 8, 12]


def test_lm_eval_reads_the_prompts_scores():
    """lm-eval's request: echo, logprobs 1, max_tokens 1."""
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=1, echoes=[ECHO])
    one_token = CompletionOutput(0, " wor", [30], None, OUT_1.logprobs, "length")
    body = asyncio.run(full(fmt, stream(chunk(one_token, prompt_logprobs=PROMPT_LPS, finished=True))))
    (choice,) = body["choices"]
    # the continuation "Hel" "lo" after the context "<s>": scored, not greedy ("Hel" was third)
    assert lm_eval_reading(choice, 1) == (pytest.approx(-2.1), False)
    assert lm_eval_reading(choice, 2) == (pytest.approx(-0.1), True)


def test_a_prompt_scored_shallower_than_logprobs_has_no_false_top():
    """prompt_logprobs 0 with logprobs 2: the entries hold the tokens only; "Hel", ranked 3rd,
    is no top-2 alternative (lm-eval would read it as greedy)."""
    shallow = [None, {10: Logprob(-2.0, 3, "Hel")}, {11: Logprob(-0.1, 1, "lo")}]
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=2, echoes=[ECHO])
    body = asyncio.run(full(fmt, stream(chunk(merged(), prompt_logprobs=shallow, finished=True))))
    assert body["choices"][0]["logprobs"]["top_logprobs"][:3] == [None, {}, {"lo": -0.1}]


def test_prompt_logprobs_in_vllm_shape_in_each_choice():
    fmt = CompletionFormat(Header("c", "m"), n=2, logprobs=None, echoes=None)
    body = asyncio.run(full(fmt, stream(chunk(merged(0), merged(1), prompt_logprobs=PROMPT_LPS,
                                              finished=True))))
    expected = [None,
                {"10": {"logprob": -2.0, "rank": 3, "decoded_token": "Hel"},
                 "20": {"logprob": -0.5, "rank": 1, "decoded_token": "A"},
                 "21": {"logprob": -1.0, "rank": 2, "decoded_token": "B"}},
                {"11": {"logprob": -0.1, "rank": 1, "decoded_token": "lo"},
                 "22": {"logprob": -2.5, "rank": 2, "decoded_token": "C"}}]
    assert [c["prompt_logprobs"] for c in body["choices"]] == [expected, expected]
    assert [c["text"] for c in body["choices"]] == [" world"] * 2  # no echo: the output only
    assert json.loads(json.dumps(body)) == body  # plain JSON (the keys are strings)
    # not asked for: no such key
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=None)
    body = asyncio.run(full(fmt, stream(chunk(merged(), finished=True))))
    assert "prompt_logprobs" not in body["choices"][0]


def test_every_choice_of_every_prompt_echoes_its_own_prompt():
    other = Echo("Bye", [7, 8], "B")
    other_lps = [None, {8: Logprob(-1.5, 2, "ye"), 9: Logprob(-0.2, 1, "ee")}]
    fmt = CompletionFormat(Header("c", "m"), n=2, logprobs=1, echoes=[ECHO, other])
    body = asyncio.run(full(
        fmt, stream(chunk(merged(0), merged(1), prompt_logprobs=PROMPT_LPS, finished=True)),
        stream(chunk(merged(0), merged(1), prompt_logprobs=other_lps, finished=True))))
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["<s>Hello world"] * 2 + ["Bye world"] * 2
    assert [c["logprobs"]["tokens"][:2] for c in choices] == [["<s>", "Hel"]] * 2 + [["B", "ye"]] * 2
    assert [c["logprobs"]["token_logprobs"][:2] for c in choices] == [[None, -2.0]] * 2 + [[None, -1.5]] * 2
    assert [len(c["prompt_logprobs"]) for c in choices] == [3, 3, 2, 2]


def test_streamed_echo_and_prompt_logprobs_come_with_each_choices_first_event():
    # choice 1 starts one chunk after choice 0; the prompt logprobs come with the first token
    first = chunk(OUT_1, prompt_logprobs=PROMPT_LPS)
    second = chunk(CompletionOutput(1, " wor", [30], None, OUT_1.logprobs), OUT_2)
    fmt = CompletionFormat(Header("c", "m"), n=2, logprobs=1, echoes=[ECHO])
    out = asyncio.run(streamed(fmt, stream(first, second, pause=True)))
    assert len(out) == 2
    (c0,) = out[0]["choices"]
    assert (c0["index"], c0["text"]) == (0, "<s>Hello wor")
    assert c0["logprobs"]["tokens"] == ["<s>", "Hel", "lo", " wor"]
    assert c0["logprobs"]["token_logprobs"][0] is None and c0["logprobs"]["top_logprobs"][0] is None
    assert c0["logprobs"]["text_offset"] == [0, 3, 6, 8]
    assert len(c0["prompt_logprobs"]) == 3
    later = {c["index"]: c for c in out[1]["choices"]}
    assert later[1]["text"] == "<s>Hello wor" and len(later[1]["prompt_logprobs"]) == 3
    assert later[1]["logprobs"]["tokens"] == ["<s>", "Hel", "lo", " wor"]
    # choice 0 goes on where it was: the output only, offsets after the echo
    assert later[0]["text"] == "ld" and "prompt_logprobs" not in later[0]
    assert later[0]["logprobs"]["tokens"] == ["ld"] and later[0]["logprobs"]["text_offset"] == [12]


def test_a_first_event_with_no_text_yet_still_echoes():
    """The first token's text held back (a partial stop string): the echo goes out anyway."""
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=None, echoes=[ECHO])
    held = CompletionOutput(0, "", [30], None, None)
    out = asyncio.run(streamed(fmt, stream(chunk(held), chunk(OUT_2), pause=True)))
    assert [e["choices"][0]["text"] for e in out] == ["<s>Hello", "ld"]


def test_echo_with_logprobs_needs_the_engines_prompt_logprobs():
    fmt = CompletionFormat(Header("c", "m"), n=1, logprobs=1, echoes=[ECHO])
    with pytest.raises(RuntimeError, match="no prompt logprobs"):
        asyncio.run(full(fmt, stream(chunk(merged(), finished=True))))


def test_chat_puts_prompt_logprobs_at_the_top_level():
    fmt = ChatFormat(Header("chat", "m"), n=1, top_logprobs=None)
    body = asyncio.run(full(fmt, stream(chunk(merged(), prompt_logprobs=PROMPT_LPS, finished=True))))
    assert body["prompt_logprobs"][0] is None and body["prompt_logprobs"][1]["20"]["rank"] == 1
    assert "prompt_logprobs" not in body["choices"][0]
    fmt = ChatFormat(Header("chat", "m"), n=1, top_logprobs=None)
    assert "prompt_logprobs" not in asyncio.run(full(fmt, stream(chunk(merged(), finished=True))))
    # streamed: in the event of the chunk that brought them, only there
    fmt = ChatFormat(Header("chat", "m"), n=1, top_logprobs=None)
    out = asyncio.run(streamed(fmt, stream(chunk(OUT_1, prompt_logprobs=PROMPT_LPS), chunk(OUT_2),
                                           pause=True)))
    assert [len(e.get("prompt_logprobs") or ()) for e in out] == [0, 3, 0]  # role, first, last
    assert out[1]["choices"][0]["delta"]["content"] == " wor"


# The request: fields, checks, what the engine is asked

def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, {"prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


@pytest.mark.parametrize("fields, prompt_logprobs", [
    ({"echo": True, "logprobs": 3}, 3),  # vLLM's: echo scores the prompt as deeply as the output
    ({"echo": True, "logprobs": 3, "prompt_logprobs": 0}, 0),  # the field wins
    ({"echo": True}, None),
    ({"logprobs": 3}, None),
    ({"prompt_logprobs": 2}, 2),
])
def test_what_completions_ask_of_the_engine(fields, prompt_logprobs):
    req = completion(**fields)
    check_completion(req)
    assert req.sampling_params(4, req.logprobs).prompt_logprobs == prompt_logprobs


def test_chat_passes_prompt_logprobs_on():
    req = chat(prompt_logprobs=2)
    assert req.sampling_params(4, check_chat(req)).prompt_logprobs == 2
    assert chat().sampling_params(4, None).prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_400_naming_it(value):
    for check, req in ((check_completion, completion(prompt_logprobs=value)),
                       (check_chat, chat(prompt_logprobs=value))):
        with pytest.raises(OpenAIError) as err:
            check(req)
        assert (err.value.status, err.value.param) == (400, "prompt_logprobs")
    for model, base in ((CompletionRequest, {"prompt": "hi"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(OpenAIError) as err:
            parse_request(model, {**base, "prompt_logprobs": "2"})
        assert (err.value.status, err.value.param) == (400, "prompt_logprobs")


# Decoding token-id prompts, in the ingress or in the tokenizer deployment

class _Remote:
    """A DeploymentHandle's method, called in this process."""

    def __init__(self, method):
        self.remote = method


def test_echoes_decode_token_id_prompts_in_process_and_in_the_tokenizer_deployment(llama_path):
    tok = PromptTokenizer(llama_path)
    ids = tok.tokenizer.encode("Hello there")
    text_ids = tok.encode_prompts(["Hi you"])[0]
    deployment = TokenizerDeployment(llama_path)
    handle = SimpleNamespace(decode=_Remote(deployment.decode))
    for route in (SimpleNamespace(module_id="m", tokenizer=None),
                  SimpleNamespace(module_id="m", tokenizer=handle)):
        ingress = SimpleNamespace(tokenizers={"m": tok} if route.tokenizer is None else {})
        echoes = asyncio.run(ECHOES(ingress, route, [ids, [5]], [ids, [5]]))
        assert echoes == [Echo(tok.tokenizer.decode(ids), ids, tok.tokenizer.decode(ids[:1])),
                          Echo(tok.tokenizer.decode([5]), [5], tok.tokenizer.decode([5]))]
        assert echoes[0].text.endswith("Hello there")
        # a string prompt is echoed as given, its tokens still named
        (echo,) = asyncio.run(ECHOES(ingress, route, ["Hi you"], [text_ids]))
        assert echo == Echo("Hi you", text_ids, tok.tokenizer.decode(text_ids[:1]))


# Prompt logprobs under prefill/decode disaggregation: the engine refuses them (ValueError)

class _RefusingPrefill:
    """The prefill deployment's handle whose streamed call raises what Ray Serve raises for
    the replica's ValueError: a RayTaskError that is also a ValueError."""

    def __init__(self, error: BaseException):
        self.error, self.prefill = error, self

    def options(self, **_):
        return self

    def remote(self, *_):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self):
        pass


def test_a_disaggregated_engines_refusal_is_a_400():
    from ray.exceptions import RayTaskError
    refusal = ValueError("prompt_logprobs are not supported with prefill/decode disaggregation yet")
    wrapped = RayTaskError("prefill", "Traceback ...", refusal).as_instanceof_cause()
    engine = DisaggregatedEngine(_RefusingPrefill(wrapped), _RefusingPrefill(AssertionError("unused")))
    ingress = SimpleNamespace(engines={"m": engine})
    request = EngineRequest("r", [1, 2], completion(prompt_logprobs=1).sampling_params(1, None), False, 0.0)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(START(ingress, SimpleNamespace(module_id="m"), [request]))
    assert err.value.status == 400
    assert err.value.message == str(refusal)


def test_a_disaggregated_module_advertises_the_context_both_roles_take():
    class Role:
        def __init__(self, max_model_len):
            self.info = SimpleNamespace(remote=self._info)
            self.max_model_len = max_model_len

        def options(self, **_):
            return self

        async def _info(self):
            return ModelInfo("m", "m", "/x", self.max_model_len, 100)

    for prefill, decode in ((512, 2048), (2048, 1024)):
        info = asyncio.run(DisaggregatedEngine(Role(prefill), Role(decode)).info())
        assert info.max_model_len == min(prefill, decode)


def test_streamed_offsets_are_the_whole_answers_when_text_is_held_back():
    """The first token's text held back (it may start a stop string), sent with the next:
    each token's text_offset is where it stands in the answer, streamed or not."""
    held = CompletionOutput(0, "", [30], None, OUT_1.logprobs)
    rest = CompletionOutput(0, " world", [31], None, OUT_2.logprobs, "length")
    whole = asyncio.run(full(CompletionFormat(Header("c", "m"), n=1, logprobs=1),
                             stream(chunk(merged(), finished=True))))
    parts = asyncio.run(streamed(CompletionFormat(Header("c", "m"), n=1, logprobs=1),
                                 stream(chunk(held), chunk(rest, finished=True), pause=True)))
    offsets = [o for e in parts for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"] == [0, 4]
