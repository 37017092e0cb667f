"""benchmarks/throughput.py: argument handling, the shape presets with random weights, the
batch-1 latency mode and the roofline arithmetic, on CPU with one layer of Qwen3-0.6B's shape."""
import json

import pytest
import torch

from flagserve.bench.throughput import format_start_up, main, parse_args
from flagserve.bench.throughput_latency import profile_batch_decode, profile_batch_prefill
from flagserve.bench.throughput_roofline import (
    kv_bytes,
    kv_bytes_per_token,
    matmul_flops,
    measure_peak_tflops,
    weight_bytes,
)
from flagserve.bench.throughput_shapes import PRESETS, write_shape
from flagserve.models.config import load_model_config

QUICK = ["--shape", "qwen3-0.6b", "--num-layers", "1", "--bandwidth-gbs", "10", "--peak-tflops", "1e-3"]


@pytest.mark.parametrize("argv, words", [
    (["--shape", "gpt5"], "invalid choice"),
    (["--shape", "qwen3-0.6b", "--model", "x"], "not allowed with"),
    (["--num-layers", "2"], "needs --shape"),
    (["--shape", "llama3-8b", "--num-layers", "0"], "positive"),
    (["--input-len", "9", "3"], "MIN <= MAX"),
    (["--latency", "--profile", "-2"], "positive"),
    (["--latency", "--phases"], "leave out --latency"),
    (["--profile-prefill", "-1"], "positive"),
    (["--latency", "--profile-prefill", "2"], "leave out --latency"),
    (["--hf-batch-size", "-1"], "--hf-batch-size"),  # an empty HF loop made a ratio of 0
    (["--num-seqs", "0"], "--num-seqs"),
    (["--heads", "3"], "a multiple of --heads"),
])
def test_bad_arguments(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_shape_defaults():
    args = parse_args(["--shape", "llama3-8b", "--input-len", "10", "20", "--output-len", "5", "7"])
    assert args.skip_hf and args.max_model_len == 27 and args.num_layers is None


def test_preset_configs_are_the_real_shapes(tmp_path):
    cfg = load_model_config(write_shape("qwen3-0.6b", tmp_path / "q"))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.head_dim, cfg.qk_norm) == (
        "Qwen3ForCausalLM", 28, 128, True)
    # 0.6B parameters in bf16 (the tied head counted once), 112 KiB of KV per token.
    assert weight_bytes(cfg, 2) == pytest.approx(2 * 0.596e9, rel=0.01)
    assert kv_bytes_per_token(cfg, 2) == 28 * 2 * 8 * 128 * 2
    llama = load_model_config(write_shape("llama3-8b", tmp_path / "l", num_layers=2))
    assert llama.num_hidden_layers == 2 and not llama.tie_word_embeddings
    assert set(PRESETS) == {"qwen3-0.6b", "llama3-8b"}


def test_kv_bytes_counts_each_decoded_tokens_context():
    # Prompt 3, 3 outputs: prefill reads 3; outputs 1 and 2 read 4 and 5 tokens of context.
    assert kv_bytes([3], [3], per_token=10) == (3 + 4 + 5) * 10
    assert kv_bytes([3, 2], [1, 2], per_token=1) == 3 + (2 + 3)


def test_throughput_run_on_random_weights(tmp_path):
    out = tmp_path / "r.json"
    result = main(QUICK + ["--num-seqs", "3", "--input-len", "33", "40", "--output-len", "2", "5",
                           "--max-num-seqs", "2", "--json", str(out)])
    assert json.loads(out.read_text())["flagserve_output_tps"] == result["flagserve_output_tps"] > 0
    assert "hf_seconds" not in result  # random weights: no HF comparison
    # The warm-up ran reversed prompts: the timed run found none of its own in the cache
    # (random ids: no block of one prompt is another's by chance).
    assert result["prefix_cache_hit_tokens"] == 0
    memory = (result["steps"] * result["weight_bytes"] + result["kv_bytes"]) / 10e9
    compute = result["flops"] / 1e9  # at --peak-tflops 1e-3
    assert result["bandwidth_floor_seconds"] == pytest.approx(memory)
    assert result["compute_floor_seconds"] == pytest.approx(compute)
    assert result["floor_seconds"] == max(memory, compute) == compute  # so slow a "device"
    assert result["roofline_ratio"] == pytest.approx(compute / result["flagserve_seconds"])


def test_the_hf_baseline_gets_the_threads_the_engine_run_found(monkeypatch):
    """The engine's thread tuner sets the process's torch threads per step: a baseline run
    after it in the same process must not inherit its last choice."""
    import argparse

    import torch

    from flagserve.bench import throughput

    def tuned(*_args):
        torch.set_num_threads(1)  # what the tuner may leave
        return 1.0, {}

    monkeypatch.setattr(throughput, "_timed_generate", tuned)
    before = torch.get_num_threads()
    args = argparse.Namespace(dtype="float32", max_num_seqs=4, max_num_batched_tokens=None,
                              backend="auto")
    try:
        torch.set_num_threads(2)
        throughput.run_flagserve("m", None, args)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_matmul_flops_counts_each_fed_token_and_each_output(tmp_path):
    cfg = load_model_config(write_shape("qwen3-0.6b", tmp_path / "q", num_layers=1))
    h, d, i, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    linears = 2 * (h * d * (2 * 16 + 2 * 8) + 3 * h * i)  # Qwen3-0.6B: 16 query, 8 KV heads
    attention = 2 * 2 * 16 * d  # per key attended
    # Prompt 3, 2 outputs: 4 tokens fed (the last output never is), attending 1 + 2 + 3 + 4
    # keys; 2 tokens through the LM head.
    assert matmul_flops(cfg, [3], [2]) == 4 * linears + 10 * attention + 2 * 2 * v * h
    assert matmul_flops(cfg, [3, 1], [2, 1]) == matmul_flops(cfg, [3], [2]) + (
        linears + attention + 2 * v * h)


def test_peak_tflops_is_a_rate():
    assert 0 < measure_peak_tflops(torch.device("cpu"), torch.float32, n=64, repeats=2) < 1e3


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]])
def test_latency_mode(capsys, flags):
    result = main(QUICK + ["--latency", "--input-len", "5", "5", "--output-len", "4", "4"] + flags)
    # token 0 is the prefill's (with async scheduling the first decode is launched before it
    # lands, and one step runs past the end: as many steps)
    assert result["decode_steps"] == 3 and result["ms_per_token"] > 0
    out = capsys.readouterr().out
    assert "ms per token" in out
    # eager on CPU: no graphs to report, only the time to a ready engine; on CUDA one bucket
    # (batch 1), its pool measured from an emptied cache (never negative)
    capture = result["graph_capture"]
    assert result["start_up_seconds"] > 0
    if torch.cuda.is_available():
        assert capture["sizes"] == 1 and capture["reserved_bytes"] >= 0
    else:
        assert capture is None
    assert format_start_up(result) + "\n" in out
    assert result["args"]["max_model_len"] == 9 and torch.get_num_threads() >= 1


def test_latency_profile(capsys):
    result = main(QUICK + ["--latency", "--input-len", "5", "5", "--output-len", "4", "4",
                           "--profile", "3"])
    out = capsys.readouterr().out
    assert "profile of 3 batch-1 decode steps" in out and "Self CPU" in out
    assert "aten::" in result["profile"] or "flagserve" in result["profile"]  # the ops are named


def test_throughput_profile_of_the_batch(capsys):
    """--profile in a throughput run: the whole batch decoding, after the timed run."""
    result = main(QUICK + ["--num-seqs", "3", "--input-len", "4", "9", "--output-len", "2", "5",
                           "--profile", "2"])
    out = capsys.readouterr().out
    assert "profile of 2 3-sequence decode steps" in out and "aten::" in result["profile"]


def test_batch_profile_leaves_the_engine_empty(llama_path):
    from flagserve import LLM
    llm = LLM(llama_path, dtype="float32", enable_prefix_caching=False)
    blocks = llm.llm_engine.block_manager
    free = blocks.num_free_blocks
    table = profile_batch_decode(llm, [[5, 6, 7], list(range(3, 40))], 3)
    assert "Self CPU" in table
    assert not llm.llm_engine.has_unfinished() and blocks.num_free_blocks == free


def test_prefill_profile_profiles_prompt_steps(llama_path):
    """The first steps of a batch added at once: chunks of the prompts (the prefill attention
    runs, the decode attention does not), and the engine is left empty."""
    from flagserve import LLM
    llm = LLM(llama_path, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=16,
              enforce_eager=True)  # kernels in a CUDA graph have no names in the table
    blocks = llm.llm_engine.block_manager
    free = blocks.num_free_blocks
    # the decode attention is a native op on CPU, a Triton kernel on CUDA
    decode_names = ("decode_attention", "_decode_kernel")
    table = profile_batch_prefill(llm, [list(range(3, 40)), list(range(5, 30))], 2)
    assert "prefill" in table and not any(name in table for name in decode_names)
    assert not llm.llm_engine.has_unfinished() and blocks.num_free_blocks == free
    decode = profile_batch_decode(llm, [list(range(3, 40))], 2)
    assert any(name in decode for name in decode_names)  # so the test above can fail


def test_phases_split_the_step_time(capsys):
    """--phases: every timed phase is counted, once."""
    from flagserve.bench import throughput_phases

    result = main(QUICK + ["--num-seqs", "3", "--input-len", "4", "9", "--output-len", "2", "5",
                           "--phases"])
    phases = result["phases_us_per_token"]
    labels = [label for label, _, _ in throughput_phases.PHASES]
    assert list(phases) == labels + ["model forward + logits", "rest of the step"]
    assert all(phases[label] > 0 for label in ("schedule", "step message", "input buffers", "samples"))
    step_us = result["step_seconds"] / result["output_tokens"] * 1e6
    assert sum(phases.values()) == pytest.approx(step_us)
    assert phases["rest of the step"] >= 0  # the phases do not overlap (nor nest)
    assert "step phases, us per output token" in capsys.readouterr().out


def test_step_mix_counts_every_step_once(capsys):
    """--phases also splits the steps by kind: every engine step in one kind, the rows of each
    kind within its bounds."""
    from flagserve.bench.throughput_phases import DECODE_ROWS, PREFILL

    result = main(QUICK + ["--num-seqs", "12", "--input-len", "4", "9", "--output-len", "2", "12",
                           "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--phases"])
    mix = {kind: (steps, seconds, share, rows) for kind, steps, seconds, share, rows in result["step_mix"]}
    assert sum(steps for steps, *_ in mix.values()) == result["steps"]
    assert sum(share for _, _, share, _ in mix.values()) == pytest.approx(1.0)
    assert sum(seconds for _, seconds, _, _ in mix.values()) >= result["step_seconds"] * 0.99
    assert PREFILL in mix and "decode 1-7 rows" in mix
    assert 1 <= mix["decode 1-7 rows"][3] <= 7 and mix.get("decode 8-31 rows", (0, 0, 0, 8))[3] >= 8
    assert set(mix) <= {PREFILL} | {label for _, label in DECODE_ROWS}
    assert "steps by kind" in capsys.readouterr().out


def test_step_mix_restores_the_engine():
    from types import SimpleNamespace

    from flagserve.bench.throughput_phases import StepMix

    class Scheduler:
        def schedule(self):
            return SimpleNamespace(seqs=[SimpleNamespace(num_computed_tokens=3, num_prompt_tokens=3)])

    class Engine:
        def __init__(self):
            self.scheduler = Scheduler()

        def step(self):
            return self.scheduler.schedule()

    engine = Engine()
    with StepMix(engine) as mix:
        engine.step()
        engine.step()
    assert mix.table()[0][:2] == ("decode 1-7 rows", 2)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)


def test_step_kind():
    from types import SimpleNamespace

    from flagserve.bench.throughput_phases import step_kind

    def seqs(n, computed=10):
        return [SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=10)] * n

    assert step_kind(SimpleNamespace(seqs=seqs(200) + seqs(1, computed=4))).startswith("prefill")
    assert [step_kind(SimpleNamespace(seqs=seqs(n))) for n in (1, 7, 8, 31, 32, 127, 128, 256)] == [
        "decode 1-7 rows", "decode 1-7 rows", "decode 8-31 rows", "decode 8-31 rows",
        "decode 32-127 rows", "decode 32-127 rows", "decode >= 128 rows", "decode >= 128 rows"]


def test_phase_timer_restores_what_it_wrapped():
    from types import SimpleNamespace

    from flagserve.bench.throughput_phases import PHASES, PhaseTimer

    def part(path: str, name: str) -> SimpleNamespace:
        return SimpleNamespace(**{name: lambda: f"{path}.{name}"})

    runner = SimpleNamespace(prepare=lambda: "prepare", sampling_batch=lambda: "batch",
                             sampler=part("sampler", "sample"))
    engine = SimpleNamespace(scheduler=part("scheduler", "schedule"),
                             step_inputs=part("step_inputs", "build"),
                             structured=part("structured", "bitmask"),
                             executor=SimpleNamespace(runner=runner),
                             _process_samples=lambda: "samples", _outputs=lambda: "outputs")
    before = dict(vars(engine)), dict(vars(runner))
    with PhaseTimer(engine) as timer:
        assert engine.scheduler.schedule() == "scheduler.schedule"
        assert engine.executor.runner.sampler.sample() == "sampler.sample"
    assert timer.totals["schedule"] > 0 and timer.totals["sampler"] > 0 and timer.totals["outputs"] == 0
    assert len(timer.totals) == len(PHASES)
    assert (dict(vars(engine)), dict(vars(runner))) == before
    assert engine.scheduler.schedule.__name__ == "<lambda>"  # unwrapped


def test_load_format_is_checked():
    from flagserve import EngineArgs
    with pytest.raises(ValueError, match="EngineArgs.load_format must be one of"):
        EngineArgs(model="m", load_format="random")


def test_start_up_line_reports_the_graphs_capture():
    capture = dict(sizes=35, seconds=4.25, reserved_bytes=3 * 2**29, budget_bytes=2**31)
    line = format_start_up({"start_up_seconds": 12.34, "graph_capture": capture})
    assert line.endswith("12.3 s  (35 decode CUDA graphs in 4.2 s, 1.50 GiB reserved of "
                         "2.00 GiB budgeted)")


def test_compile_recorder_chains_and_restores_the_hook():
    """recorded() sees every variant Triton is about to build, passes it on to a hook set before
    it (whose True still skips the build), and puts that hook back."""
    from flagserve.bench import triton_compiles
    knobs = pytest.importorskip("triton").knobs
    before = []
    knobs.runtime.jit_cache_hook = lambda *, repr, **_: before.append(repr) or repr == "skip"
    try:
        with triton_compiles.recorded() as seen:
            hook = knobs.runtime.jit_cache_hook
            assert hook(repr="_decode_kernel[...]", key=1) is False
            assert hook(repr="skip", key=2) is True
        assert seen == ["_decode_kernel[...]", "skip"] and before == seen
        assert knobs.runtime.jit_cache_hook is not hook
        knobs.runtime.jit_cache_hook(repr="after", key=3)
        assert seen == ["_decode_kernel[...]", "skip"] and before[-1] == "after"
    finally:
        knobs.runtime.jit_cache_hook = None


def test_the_command_line_names_a_model_that_is_not_there(monkeypatch, tmp_path):
    from flagserve.bench.throughput import cli
    monkeypatch.setattr("sys.argv", ["throughput.py", "--model", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as exit_:
        cli()
    assert str(exit_.value).startswith("throughput.py: no config.json in model directory")
