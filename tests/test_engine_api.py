"""LLMEngine's contract with its drivers (the offline LLM and the server loop)."""
import json
import pickle
import shutil

import pytest
import torch

from flagserve import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from flagserve.engine.outputs import FinishReason


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(EngineArgs(model=llama_path, dtype="float32", max_model_len=128))


def drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_finish_reason_reads_as_its_plain_value():
    """API bodies (json), metric labels (str) and f-strings see "stop", never the enum name."""
    for reason in FinishReason:
        assert json.dumps(reason) == f'"{reason.value}"' and str(reason) == f"{reason}" == reason.value


def test_abort_frees_blocks_and_silences_the_request(engine):
    engine.add_request("keep", "We cook rice and beans", SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("drop", "The weather today is sunny " * 4,
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort("drop")
    engine.abort("unknown-id")  # ignored
    outs = drain(engine)
    assert {o.request_id for o in outs} == {"keep"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_delta_outputs_concatenate_to_the_final_text(engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zq"],
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", "Old computers", params)
    pieces, tokens = [], []
    for out in drain(engine):
        pieces.append(out.outputs[0].text)
        tokens.extend(out.outputs[0].token_ids)
    engine.add_request("c", "Old computers", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                            output_kind=RequestOutputKind.FINAL_ONLY))
    [final] = drain(engine)
    expected = final.outputs[0]
    assert "".join(pieces) == expected.text and tokens == expected.token_ids


def test_final_only_is_one_output_equal_to_the_last_cumulative_one(engine):
    """FINAL_ONLY requests get no output until all their samples end (the step skips them):
    exactly one, the same as the cumulative request's last, also when the samples end apart."""
    def run(kind: RequestOutputKind, stop_ids: list[int]) -> list:
        engine.add_request(str(kind), "Old computers", SamplingParams(
            n=3, seed=7, temperature=1.0, max_tokens=12, stop_token_ids=stop_ids, output_kind=kind))
        return drain(engine)

    first = run(RequestOutputKind.CUMULATIVE, [])[-1].outputs[0].token_ids
    stop = [first[2]]  # the first sample ends by its third token, the others (likely) later
    cumulative = run(RequestOutputKind.CUMULATIVE, stop)
    [final] = run(RequestOutputKind.FINAL_ONLY, stop)
    assert final.finished and final.outputs == cumulative[-1].outputs
    assert len({len(c.token_ids) for c in final.outputs}) > 1  # the samples did end apart


def test_delta_outputs_carry_each_finished_sample_once(engine):
    """n samples that end apart: a sample's finish is in one DELTA output, later outputs leave
    it out (a stream would repeat its end), and the deltas still add up to the final outputs."""
    def params(kind: RequestOutputKind, stop_ids: list[int]) -> SamplingParams:
        return SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, stop_token_ids=stop_ids,
                              output_kind=kind)

    engine.add_request("probe", "Old computers", params(RequestOutputKind.CUMULATIVE, []))
    stop = [drain(engine)[-1].outputs[0].token_ids[2]]  # sample 0 ends by its third token
    engine.add_request("final", "Old computers", params(RequestOutputKind.FINAL_ONLY, stop))
    [final] = drain(engine)
    engine.add_request("delta", "Old computers", params(RequestOutputKind.DELTA, stop))
    deltas = drain(engine)
    ends = [c.index for out in deltas for c in out.outputs if c.finish_reason is not None]
    assert sorted(ends) == [0, 1, 2]  # each sample's end exactly once
    assert len({len(c.token_ids) for c in final.outputs}) > 1  # the samples did end apart
    for want in final.outputs:
        mine = [c for out in deltas for c in out.outputs if c.index == want.index]
        assert [t for c in mine for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in mine) == want.text


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_without_detokenize_the_tokens_are_the_same_and_there_is_no_text(engine, kind):
    """vLLM's detokenize=False: the same tokens and logprobs, no text anywhere."""
    def run(detokenize: bool) -> list:
        engine.add_request(f"{kind}-{detokenize}", "Old computers", SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, output_kind=kind,
            detokenize=detokenize))
        return drain(engine)

    plain, with_text = run(False), run(True)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in with_text]
    assert "".join(o.outputs[0].text for o in with_text)  # the model does write text
    assert all(o.outputs[0].text == "" for o in plain)
    for a, b in zip(plain[-1].outputs[0].logprobs, with_text[-1].outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}
        assert all(lp.decoded_token is None for lp in a.values())
    with pytest.raises(ValueError, match="SamplingParams.stop needs detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="SamplingParams.detokenize must be true or false"):
        SamplingParams(detokenize="no")


@pytest.mark.parametrize("prompt,message", [
    ([], "empty"),
    ("word " * 400, "max_model_len"),
    ([1, 2, 10**9], "token ids"),
])
def test_bad_prompts_raise_clear_errors(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams())
    assert not engine.has_unfinished()


def test_a_kv_cache_smaller_than_one_sequence_is_refused_at_start(llama_path):
    """num_kv_blocks that cannot hold max_model_len tokens: a sequence past it would preempt
    itself forever (a hang), so the engine refuses to start, naming both keys (vLLM's rule)."""
    with pytest.raises(ValueError, match=r"holds 4 blocks of 16 tokens, 64 tokens, fewer than "
                                         r"max_model_len=128: lower max_model_len, or raise num_kv_blocks"):
        LLMEngine(EngineArgs(model=llama_path, dtype="float32", num_kv_blocks=4, max_model_len=128))
    LLMEngine(EngineArgs(model=llama_path, dtype="float32", num_kv_blocks=4, max_model_len=64))


def test_prompt_ids_past_the_tokenizer_in_a_padded_vocabulary(tiny_model_factory):
    """A padded vocabulary's gap (embedding rows, no tokens) is refused in prompts, as vLLM does."""
    from flagserve.models.tiny import VOCAB_SIZE
    path = tiny_model_factory("llama", vocab_size=VOCAB_SIZE + 64)
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=64))
    assert engine.prompt_vocab_size == VOCAB_SIZE
    from flagserve.engine.core.thread import EngineThread
    assert EngineThread(engine).vocab_size == VOCAB_SIZE  # what the server's checks are given
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB_SIZE}\), the tokenizer's"):
        engine.add_request("gap", [1, VOCAB_SIZE + 3], SamplingParams(max_tokens=2))
    engine.add_request("last", [1, VOCAB_SIZE - 1], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.request_id for o in drain(engine) if o.finished] == ["last"]


@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("top_k", 2**63), ("temperature", float("inf")), ("stop_token_ids", [10**6]),
    ("logprobs", 10**6),
])
def test_params_that_skipped_validation_fail_their_request_only(engine, field, value):
    """The engine process gets params pickled (no __post_init__); a value the step cannot take
    must fail add_request, not the step every request of the batch shares."""
    engine.add_request("ok", "We cook rice", SamplingParams(max_tokens=3, ignore_eos=True))
    params = SamplingParams(max_tokens=3, min_tokens=2)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        engine.add_request("bad", "hi", pickle.loads(pickle.dumps(params)))
    outs = drain(engine)
    assert [o.request_id for o in outs if o.finished] == ["ok"]


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    drain(engine)


def test_generation_stops_at_max_model_len(engine):
    engine.add_request("long", [5] * 100, SamplingParams(max_tokens=None, ignore_eos=True))
    out = drain(engine)[-1]
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"


def test_unsupported_architecture_lists_supported(llama_path, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(bad))


def test_missing_model_directory_is_named(tmp_path, llama_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    # a tokenizer that is not a local path: named, not looked up on the Hub
    with pytest.raises(FileNotFoundError, match="no tokenizer directory 'org/some-tokenizer'"):
        LLM(llama_path, tokenizer="org/some-tokenizer")


def test_a_pathlib_path_is_a_model_path(llama_path):
    from pathlib import Path

    from flagserve import EngineArgs
    args = EngineArgs(model=Path(llama_path))
    assert args.model == llama_path and isinstance(args.model, str)


@pytest.mark.parametrize("kw,field", [({"dtype": "int8"}, "dtype"), ({"block_size": 12}, "block_size"),
                                      ({"attention_backend": "cuda"}, "attention_backend")])
def test_bad_engine_args_name_the_field(llama_path, kw, field):
    with pytest.raises(ValueError, match=f"EngineArgs.{field}"):
        LLM(llama_path, **kw)


def test_token_id_prompts_chat_and_progress_bar(llama_path, capsys):
    llm = LLM(llama_path, dtype="float32")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(["Old computers"] * 3, params)  # use_tqdm defaults to True
    assert "Processed prompts" in capsys.readouterr().err
    by_ids = llm.generate([tok.encode("Old computers")], params, use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids
    assert by_ids[0].prompt is None and by_text[0].prompt == "Old computers"
    by_dict = llm.generate([{"prompt_token_ids": tok.encode("Old computers")},
                            {"prompt": "Old computers"}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_dict] == [by_text[0].outputs[0].token_ids] * 2
    with pytest.raises(ValueError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"prompt_ids": [1, 2]}, params)
    chat = llm.chat([{"role": "user", "content": "Hi there"}], params, use_tqdm=False)[0]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    # vLLM's arguments: the same prompt the server renders for tools and template variables.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    conv = [{"role": "user", "content": "Hi there"}]
    with_tools = llm.chat(conv, params, use_tqdm=False, tools=[tool])[0]
    assert "get_weather" in tok.decode(with_tools.prompt_token_ids)
    bare = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert bare.prompt_token_ids == tok.encode(tok.apply_chat_template(conv, tokenize=False),
                                               add_special_tokens=False)
    prefill = [*conv, {"role": "assistant", "content": "Well,"}]
    going_on = llm.chat(prefill, params, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert tok.decode(going_on.prompt_token_ids).endswith("Well,")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(prefill, params, continue_final_message=True)


# How far a half-precision engine's first logprob may sit from fp32's on the tiny model. CPU
# kernels accumulate in fp32; on CUDA bf16 matmuls and our Triton kernels round more (0.15 was
# measured on an H100), fp16 keeps 3 more mantissa bits than bf16.
HALF_LOGPROB_TOL = {("cpu", "float16"): 0.1, ("cpu", "bfloat16"): 0.1,
                    ("cuda", "float16"): 0.1, ("cuda", "bfloat16"): 0.3}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs(llama_path, dtype, device):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    half = LLM(llama_path, dtype=dtype, device=device).generate(
        ["The weather today"], params, use_tqdm=False)[0].outputs[0]
    full = LLM(llama_path, dtype="float32", device="cpu").generate(
        ["The weather today"], params, use_tqdm=False)[0].outputs[0]
    assert half.token_ids[0] == full.token_ids[0]  # the decisive tiny model agrees at first
    assert half.logprobs[0][half.token_ids[0]].logprob == pytest.approx(
        full.logprobs[0][full.token_ids[0]].logprob, abs=HALF_LOGPROB_TOL[device, dtype])


@pytest.mark.parametrize("field,value", [
    ("enable_prefix_caching", "no"), ("enable_chunked_prefill", None), ("enforce_eager", 1),
    ("max_num_seqs", True), ("block_size", True), ("block_size", 24), ("max_model_len", 0),
    ("num_kv_blocks", 2.5), ("seed", 1.5), ("seed", 2**70), ("seed", "abc"),
    ("cpu_kv_cache_space_gib", float("inf")), ("gpu_memory_utilization", "0.5"),
    ("gpu_memory_utilization", 1.5), ("device", "tpu"), ("dtype", "fp8"), ("tokenizer", 3),
])
def test_engine_args_name_the_field_of_a_bad_value(field, value):
    """Checked when built, not found later as another error deep in the engine."""
    with pytest.raises(ValueError, match=rf"EngineArgs\.{field} "):
        EngineArgs(model="m", **{field: value})
    EngineArgs(model="m", device="cuda:1", seed=-5, cpu_kv_cache_space_gib=1)
