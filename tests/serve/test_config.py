"""Config validation: every bad config gives one message naming the key and exit code 2,
without a traceback and without starting anything."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flagserve.config import parse_config
from flagserve.engine.engine_args import EngineArgs
from flagserve.runner.cli import EXIT_CONFIG, execute
from tests.serve.conftest import REPO, run_py


def composed(*overrides: str, config_dir: Path = REPO / "conf"):
    """The experiment with the tiny model's graph (these cases name its sizes), unless a
    `serve=` group is given."""
    if config_dir == REPO / "conf" and not any(o.startswith("serve=") for o in overrides):
        overrides = ("serve=tiny", *overrides)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("serve", overrides=list(overrides))


def run(capsys, *overrides: str, config_dir: Path = REPO / "conf") -> tuple[int, str, str]:
    code = execute(composed("action=plan", *overrides, config_dir=config_dir))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def graph(tmp_path):
    """Write user-module files so depends tests have real modules."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("class M:\n    def __call__(self, body):\n        return body\n")
    return tmp_path


def user(mid: str, path: Path, depends: str) -> list[str]:
    return [f"+serve.{mid}.module={path / (mid + '.py')}", f"+serve.{mid}.name=M",
            f"+serve.{mid}.depends={depends}"]


def test_default_config_plans(capsys):
    code, out, err = run(capsys)
    assert code == 0, err
    assert "llm-engine" in out and "KV cache" in out and "tokens" in out
    assert "llm-tokenizer" not in out  # tokenized in the ingress unless asked for
    assert "model tiny-llama," in out and "plan for tiny:" in out  # its own experiment name
    code, out, err = run(capsys, "serve.llm.tiny_model=mistral")
    assert code == 0 and "model tiny-mistral," in out, err


@pytest.mark.parametrize("override,key", [
    ("serve.llm.engine_args.num_kv_blocks=1", "num_kv_blocks"),
    ("serve.llm.engine_args.cpu_kv_cache_space_gib=0.0001", "cpu_kv_cache_space_gib")])
def test_a_kv_cache_the_engine_would_refuse_is_a_config_error_in_plan(capsys, override, key):
    """On CPU (or with num_kv_blocks) the plan counts what the engine counts: it would refuse."""
    code, _, err = run(capsys, override)
    assert code == EXIT_CONFIG and f"config error at `serve.llm.engine_args.{key}`" in err, err
    assert "fewer than max_model_len" in err


def test_ingress_and_http_server_modes():
    from flagserve.config import parse_config
    from flagserve.config.topology import direct_http, ingress_in_engine

    def resolved(*overrides):
        from omegaconf import OmegaConf
        config, _ = parse_config(OmegaConf.to_container(composed(*overrides), resolve=True))
        return ingress_in_engine(config), direct_http(config)

    assert resolved() == ("llm", True)  # the default: one LLM, one host
    assert resolved("experiment.runner.deploy.ingress_replicas=2") == (None, True)
    assert resolved("experiment.runner.deploy.ingress=separate") == (None, True)
    assert resolved("experiment.runner.deploy.http_server=serve_proxy") == ("llm", False)
    # Several engine replicas: a separate ingress, whose handle routes by prefix and load
    # (serve.llm.router) and whose calls autoscaling counts, so it can listen itself.
    autoscaled = ("serve.llm.resources.min_replicas=1", "serve.llm.resources.max_replicas=2")
    assert resolved(*autoscaled) == (None, True)
    assert resolved("serve.llm.resources.num_replicas=2") == (None, True)
    assert resolved("serve.llm.resources.num_replicas=2", "experiment.runner.deploy.ingress=engine") \
        == ("llm", True)
    # The engine replicas serve HTTP and autoscale: Serve's request counts need its proxy.
    assert resolved(*autoscaled, "experiment.runner.deploy.ingress=engine") == ("llm", False)
    assert resolved("+serve.other.engine_args.model=x", "+serve.other.model_name=o") == (None, True)


def test_served_engines_default_step_budget():
    """A served engine's step budget: as set, else 2048 on CPU (an offline LLM's 4096 is the
    engine's own default), 16384 on a GPU; without chunked prefill the engine's max_model_len."""
    from omegaconf import OmegaConf

    from flagserve.config import parse_config
    from flagserve.config.hostfile import Host
    from flagserve.config.topology import served_engine_args
    from flagserve.engine.engine_args import EngineArgs

    def budget(*overrides, gpus=0):
        config, _ = parse_config(OmegaConf.to_container(
            composed("serve.llm.engine_args.model=/m", *overrides), resolve=True))
        host = Host("127.0.0.1", gpus or 2, "gpu" if gpus else "cpu")
        return served_engine_args(config.serve["llm"], [host]).max_num_batched_tokens

    assert EngineArgs.max_num_batched_tokens is None  # offline: kv_budget's 4096 on CPU
    assert budget() == 2048
    assert budget("serve.llm.engine_args.device=auto", gpus=1) == 16384
    assert budget("serve.llm.engine_args.max_num_batched_tokens=512") == 512
    assert budget("serve.llm.engine_args.enable_chunked_prefill=false") is None


def test_plan_shows_the_router_of_several_engine_replicas(capsys):
    code, out, err = run(capsys, "serve.llm.resources.num_replicas=2",
                         "serve.llm.router.strategy=round_robin")
    assert code == 0, err
    assert re.search(r"llm-engine\s+2\s.*routed round_robin", out), out
    code, out, err = run(capsys)  # one replica: nothing to route
    assert code == 0 and "routed" not in out, err


def test_engine_ingress_needs_one_llm(capsys):
    code, _, err = run(capsys, "experiment.runner.deploy.ingress=engine",
                       "+serve.other.tiny_model=qwen2", "+serve.other.model_name=other")
    assert code == EXIT_CONFIG and "`experiment.runner.deploy.ingress`" in err
    assert "exactly one LLM module" in err


def test_tokenizer_deployment_is_optional(capsys):
    code, out, err = run(capsys, "serve.llm.tokenizer.num_replicas=2")
    assert code == 0, err
    assert re.search(r"llm-tokenizer\s+2\b", out), out


@pytest.mark.parametrize("overrides,key,words", [
    (["+serve.llm.engine_args.max_num_seq=8"], "serve.llm.engine_args.max_num_seq",
     "did you mean `max_num_seqs`"),
    (["+experiment.runner.deploy.prot=1"], "experiment.runner.deploy.prot", "did you mean `port`"),
    (["experiment.exp_dir="], "experiment.exp_dir", "must not be empty"),  # not the working dir
    (["serve.llm.engine_args.max_num_seqs=many"], "serve.llm.engine_args.max_num_seqs", "integer"),
    (["serve.llm.engine_args.max_num_seqs=0"], "serve.llm.engine_args.max_num_seqs", ">= 1"),
    (["experiment.runner.deploy.port=http"], "experiment.runner.deploy.port", "integer"),
    (["serve.llm.engine_args.model=/no/such/model"], "serve.llm.engine_args.model", "does not exist"),
    (["serve.llm.engine_args.tokenizer=/no/such/tokenizer"], "serve.llm.engine_args.tokenizer",
     "does not exist"),
    (["serve.llm.engine_args.max_model_len=4096"], "serve.llm.engine_args.max_model_len", "2048"),
    (["serve.llm.engine=sglang"], "serve.llm.engine", "serve.llm.engine=flagserve"),
    (["action=deploy"], "action", "run, stop, status, test, plan"),
    (["serve.llm.engine_args.device=cuda"], "serve.llm.engine_args.device", "no host has one"),
    (["serve.llm.resources.min_replicas=3"], "serve.llm.resources.max_replicas", "both"),
    (["serve.llm.tokenizer.num_replicas=-1"], "serve.llm.tokenizer.num_replicas", ">= 0"),
    (["serve.llm.resources.num_replicas=0"], "serve.llm.resources.num_replicas", ">= 1"),
    (["serve.llm.resources.min_replicas=1", "serve.llm.resources.max_replicas=2",
      "serve.llm.resources.target_ongoing_requests=0"],
     "serve.llm.resources.target_ongoing_requests", "must be > 0, got 0"),
    (["serve.llm.engine_args.tensor_parallel_size=3"], "serve.llm.engine_args.tensor_parallel_size",
     "must divide the model's num_attention_heads=4, got 3"),
    (["serve.llm.engine_args.pipeline_parallel_size=3"],
     "serve.llm.engine_args.pipeline_parallel_size", "at most the model's 2 layers"),
    (["serve.llm.engine_args.tensor_parallel_size=3"], "serve.llm.engine_args.tensor_parallel_size",
     "fix: use one of 1, 2"),
    (["serve.llm.engine_args.pipeline_parallel_size=3"],
     "serve.llm.engine_args.pipeline_parallel_size", "fix: use at most 2 (the model's layers)"),
    (["experiment.runner.deploy.ingress=router"], "experiment.runner.deploy.ingress",
     "auto, engine, separate"),
    (["experiment.runner.deploy.drain_timeout_s=-1"], "experiment.runner.deploy.drain_timeout_s",
     "must be >= 0"),
    (["experiment.runner.deploy.limits.max_n=0"], "experiment.runner.deploy.limits.max_n",
     "must be >= 1, got 0"),
    (["experiment.runner.deploy.limits.max_body_bytes=-5"],
     "experiment.runner.deploy.limits.max_body_bytes", "must be >= 1, got -5"),
    (["experiment.runner.deploy.http_server=nginx"], "experiment.runner.deploy.http_server",
     "auto, replicas, serve_proxy"),
    (["experiment.runner.deploy.ingress=engine", "experiment.runner.deploy.ingress_replicas=2"],
     "experiment.runner.deploy.ingress_replicas", "resources.num_replicas"),
    (["experiment.runner.deploy.http_server=replicas", "experiment.runner.deploy.ingress=engine",
      "serve.llm.resources.min_replicas=1", "serve.llm.resources.max_replicas=2"],
     "experiment.runner.deploy.http_server", "autoscaling"),
    (["serve.llm.engine_core=fork"], "serve.llm.engine_core", "auto, process, thread"),
    (["serve.llm.router.strategy=random"], "serve.llm.router.strategy",
     "prefix_aware, least_loaded, round_robin"),
    (["serve.llm.router.prefix_blocks=0"], "serve.llm.router.prefix_blocks", "must be >= 1"),
    (["serve.llm.router.max_imbalance=-1"], "serve.llm.router.max_imbalance", "must be >= 0"),
    (["serve.llm.router.stats_period_s=0"], "serve.llm.router.stats_period_s", "must be > 0"),
    (["+serve.llm.router.prefix_len=4"], "serve.llm.router.prefix_len", "did you mean"),
    (["serve.llm.tiny_model=gpt2"], "serve.llm.tiny_model", "llama, mistral, qwen2, qwen3, null"),
    (["experiment.runner.ssh.known_hosts=trust"], "experiment.runner.ssh.known_hosts",
     "strict, auto_add, ignore"),
    (["serve.llm.engine_core=process", "serve.llm.engine_args.tensor_parallel_size=2"],
     "serve.llm.engine_core", "TP = PP = 1"),
])
def test_bad_config(capsys, overrides, key, words):
    code, out, err = run(capsys, *overrides)
    assert code == EXIT_CONFIG
    assert f"`{key}`" in err and words in err and "fix:" in err
    assert "Traceback" not in err and not out


def test_depends_cycle_and_dangling(capsys, graph):
    code, _, err = run(capsys, *user("a", graph, "[b]"), *user("b", graph, "[a]"))
    assert code == EXIT_CONFIG and "dependency cycle" in err and "a -> b -> a" in err
    code, _, err = run(capsys, *user("a", graph, "[ghost]"))
    assert code == EXIT_CONFIG and "`serve.a.depends`" in err and "unknown module 'ghost'" in err
    code, _, err = run(capsys, *user("a", graph, "[llm]"))
    assert code == EXIT_CONFIG and "is an LLM" in err


def test_user_module_init_args_are_checked_against_its_init(capsys, tmp_path):
    (tmp_path / "a.py").write_text("class M:\n    def __init__(self, top_k=2, *, tag='x'):\n"
                                   "        pass\n    def __call__(self, body):\n"
                                   "        return body\n")
    code, _, err = run(capsys, *user("a", tmp_path, "[]"), "+serve.a.init_args.nope=1")
    assert code == EXIT_CONFIG and "`serve.a.init_args.nope`" in err
    assert "M.__init__ takes no argument 'nope'" in err and "use one of: tag, top_k" in err
    code, _, err = run(capsys, *user("a", tmp_path, "[]"), "+serve.a.init_args.top_k=3",
                       "+serve.a.init_args.tag=y")
    assert code == 0, err


def test_more_gpus_than_hosts(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1 type=gpu\n")
    code, _, err = run(capsys, f"experiment.runner.hostfile={hostfile}",
                       "serve.llm.engine_args.device=auto", "serve.llm.resources.num_replicas=2")
    assert code == EXIT_CONFIG and "ask for 2 GPUs" in err and "have 1" in err
    code, _, err = run(capsys, f"experiment.runner.hostfile={hostfile}",
                       "serve.llm.engine_args.device=auto",
                       "serve.llm.engine_args.tensor_parallel_size=2")
    assert code == EXIT_CONFIG and "tensor_parallel_size" in err and "largest host has 1" in err


def test_bad_hostfile(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.1 slots=8\n10.0.0.1 slots=8\n")
    code, _, err = run(capsys, f"experiment.runner.hostfile={hostfile}")
    assert code == EXIT_CONFIG and "duplicate host 10.0.0.1" in err and ":2:" in err
    hostfile.write_text("10.0.0.1 slots=8\n10.0.0.2:2222 slots=8\n")  # failed at SSH connect
    code, _, err = run(capsys, f"experiment.runner.hostfile={hostfile}")
    assert code == EXIT_CONFIG and ":2: '10.0.0.2:2222 slots=8'" in err and "ssh_port=2222" in err


@pytest.mark.parametrize("port, why", [
    (10002, "worker port range 10002-19999"), (19999, "worker port range 10002-19999"),
    (10001, "the Ray client server"), (8265, "the Ray dashboard"),
    (52365, "the Ray dashboard agent"), (8000, "also experiment.runner.deploy.port")])
def test_ray_port_ray_takes_itself_is_a_config_error(capsys, port, why):
    """Ray refused these with a long traceback once the head started; now plan says so."""
    code, _, err = run(capsys, f"experiment.runner.hostfile={REPO}/hostfiles/two_nodes.txt",
                       f"+experiment.runner.ray_port={port}")
    assert code == EXIT_CONFIG and "`experiment.runner.ray_port`" in err, err
    assert why in err and "use 6379" in err and "Traceback" not in err


def fake_model(path: Path, **cfg) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 8192,
        "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        "rope_theta": 1000000.0, **cfg}))
    return path


def test_flagscale_list_form_and_plan_across_hosts(capsys, tmp_path, monkeypatch):
    """A FlagScale-style serve list (engine: vllm, vLLM flags) plans a TP 8 x PP 2 deployment
    over two hosts, with memory estimated from config.json alone."""
    monkeypatch.setenv("QWEN72_PATH", str(fake_model(tmp_path / "qwen72b")))
    code, out, err = run(capsys, "serve=72b_two_nodes",
                         f"experiment.runner.hostfile={REPO}/hostfiles/two_nodes.txt",
                         config_dir=REPO / "examples/qwen2_5/conf")
    assert code == 0, err
    assert "plan for qwen2.5_72b_two_nodes:" in out  # a variant is an experiment of its own
    assert "replica 0 stage 0: 10.0.0.1 gpu 0,1,2,3,4,5,6,7" in out
    assert "replica 0 stage 1: 10.0.0.2 gpu 0,1,2,3,4,5,6,7" in out
    assert "weights" in out and "KV cache" in out and "assumed" in out

    monkeypatch.setenv("QWEN_PATH", str(fake_model(tmp_path / "qwen7b", num_hidden_layers=28)))
    code, out, err = run(capsys, f"experiment.runner.hostfile={REPO}/hostfiles/single_gpu.txt",
                         config_dir=REPO / "examples/qwen2_5/conf")
    assert code == 0, err
    assert "`vllm` is served by FlagServe's own engine" in err
    assert "ignoring vLLM-only trust_remote_code" in err
    assert "Qwen2.5-7B-Instruct" in out
    # the list form is overridden by index: its errors name the keys that way
    code, _, err = run(capsys, f"experiment.runner.hostfile={REPO}/hostfiles/single_gpu.txt",
                       "serve.0.engine_args.max_model_len=999999",
                       config_dir=REPO / "examples/qwen2_5/conf")
    assert code == EXIT_CONFIG and "config error at `serve.0.engine_args.max_model_len`" in err, err
    assert "fix: set serve.0.engine_args.max_model_len <=" in err and "serve.qwen" not in err


def test_flagscale_use_fs_serve_is_accepted_and_dropped():
    from flagserve.config import parse_config
    config, notes = parse_config({"experiment": {"runner": {"deploy": {"use_fs_serve": True}}}})
    assert not hasattr(config.deploy, "use_fs_serve")
    assert any("use_fs_serve" in n for n in notes)


def test_flagscale_port_moves_to_deploy():
    from flagserve.config import parse_config
    config, notes = parse_config({"serve": [{"serve_id": "m", "engine": "vllm", "engine_args": {
        "model": "/x", "port": 9010, "no_enable_prefix_caching": True, "max-num-seqs": 8}}]})
    assert config.deploy.port == 9010
    assert config.serve["m"].engine_args == {"model": "/x", "enable_prefix_caching": False,
                                             "max_num_seqs": 8}
    assert any("deploy.port" in n for n in notes)


@pytest.mark.parametrize("args,words", [
    # a key missing from the YAML stops Hydra; the message is still the project's one
    (["serve.llm.engine_args.max_num_seq=8"],
     "config error at `serve.llm.engine_args.max_num_seq`: unknown key\n"
     "  fix: did you mean `max_num_seqs`?"),
    (["experiment.runner.deploy.prot=1"], "did you mean `port`?"),
    (["serve=nope"], "config error at `serve`: Could not find 'serve/nope'\n  fix: use one of: "),
    (["serve.llm.engine_args.max_num_seqs=0"], "`serve.llm.engine_args.max_num_seqs`"),
    (["serve.llm.engine_args.enable_prefix_caching=maybe"], "must be true/false, got str 'maybe'"),
    # FlagScale's list form is indexed by position; the override names the entry's serve_id
    (["--config-path", "examples/qwen2_5/conf", "--config-name", "serve",
      "serve.qwen.engine_args.max_model_len=2048"],
     "config error at `serve.qwen.engine_args.max_model_len`: `serve` is a list in this config "
     "file (FlagScale's list form), indexed by position, not by 'qwen'\n"
     "  fix: use the entry's position, e.g. serve.0.engine_args.max_model_len=... for the first"),
])
def test_cli_exit_code_2_without_traceback(args, words):
    result = run_py(*args, "action=plan", timeout=120)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert "HYDRA_FULL_ERROR" not in result.stderr and "not in struct" not in result.stderr


def test_documented_engine_args_need_no_plus(capsys):
    code, out, err = run(capsys, "serve.llm.engine_args.block_size=32", "serve.llm.engine_args.seed=3",
                         "serve.llm.engine_args.num_kv_blocks=64",
                         "serve.llm.engine_args.attention_backend=torch",
                         "serve.llm.engine_args.max_num_batched_tokens=512")
    assert code == 0, err


def test_schema_keys_missing_from_a_file_name_the_plus_form():
    from hydra.errors import ConfigCompositionException

    from flagserve.config.overrides import known_keys, override_error
    assert "drain_timeout_s" in known_keys(["experiment", "runner", "deploy"])
    assert {"engine_args", "module", "init_args"} <= set(known_keys(["serve", "x"]))
    assert known_keys(["experiment", "envs"]) is None  # free-form: no did-you-mean
    cause = KeyError("Key 'seed' is not in struct")
    cause.full_key = "serve.llm.engine_args.seed"
    err = ConfigCompositionException("Could not override 'serve.llm.engine_args.seed'.")
    err.__cause__ = cause
    assert str(override_error(err)) == (
        "config error at `serve.llm.engine_args.seed`: is not listed in this config file\n"
        "  fix: add it with +serve.llm.engine_args.seed=<value>")
    cause.full_key = "experiment.envs.FOO"  # a free-form mapping: the same fix, not a did-you-mean
    assert str(override_error(err)).endswith("fix: add it with +experiment.envs.FOO=<value>")
    # FlagScale's list form: OmegaConf's serve[0] as the command line types it, and the fix
    # reaches down to the field the override sets
    cause.full_key = "serve[0].resources"
    error = override_error(err, ["serve.0.resources.num_replicas=2"])
    assert error.key == "serve.0.resources"
    assert error.fix == "add it with +serve.0.resources.num_replicas=<value>"


def test_an_override_hydra_cannot_parse_gets_the_quoting_fix():
    from hydra.errors import OverrideParseException

    from flagserve.config.overrides import override_error
    with pytest.raises(OverrideParseException) as err:
        composed("experiment.cmds.before_start=echo a >&2; exit 3")
    error = override_error(err.value)
    assert error.key == "experiment.cmds.before_start" and "in quotes" in error.fix


def test_the_default_graph_serves_smollm2(capsys):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        code = execute(compose("serve", overrides=["action=plan"]))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "model smollm2-135m-instruct" in out
    assert "LlamaForCausalLM, float32, 135M parameters" in out


def test_the_plan_counts_gguf_blocks_only_where_the_engine_keeps_them(capsys):
    def weights(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            assert execute(compose("serve", overrides=["action=plan", *overrides])) == 0
        out, _ = capsys.readouterr()
        return next(line for line in out.splitlines() if line.strip().startswith("weights"))
    default = weights()
    assert weights("+experiment.envs.FLAGSERVE_CPU_WEIGHTS=float32") != default
    assert weights("+experiment.envs.FLAGSERVE_CPU_MATMUL=aten") \
        == weights("+experiment.envs.FLAGSERVE_CPU_WEIGHTS=float32")


@pytest.mark.parametrize("name,value,words", [
    ("FLAGSERVE_CPU_MATMUL", "mkl", "must be one of auto, aten, native, onednn, got 'mkl'"),
    ("FLAGSERVE_CPU_NATIVE_LAYERS", "false", "YAML reads a bare on/off as a boolean"),
    ("FLAGSERVE_CPU_BIND", "abc", "FLAGSERVE_CPU_BIND must be auto, off or cores"),
    ("FLAGSERVE_CPU_BIND", "4096", "names cores [4096] that this host does not run on"),
])
def test_engine_settings_in_envs_are_checked_at_plan(capsys, name, value, words):
    code, _, err = run(capsys, f"+experiment.envs.{name}={value}")
    assert code == EXIT_CONFIG and f"`experiment.envs.{name}`" in err and words in err, err


@pytest.mark.usefixtures("llama_path")  # the built-in tiny model exists: nothing to build
def test_commands_resolve_the_config_without_importing_torch(tmp_path):
    """Every run.py command composes and resolves the config (the built-in tiny model's path
    included); importing torch for it cost each command 2 s."""
    code = ("import runpy, sys\n"
            "sys.argv = ['run.py', '--config-name', 'serve', 'serve=tiny', "
            f"'experiment.exp_dir={tmp_path}', 'action=plan']\n"
            "try:\n    runpy.run_path('run.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "torch imported: False", out.stdout


def test_a_truncated_checkpoint_is_a_config_error_in_plan(capsys, tmp_path, llama_path):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a download cut short
    code, _, err = run(capsys, f"serve.llm.engine_args.model={model}")
    assert code == EXIT_CONFIG and "Traceback" not in err, err
    assert "`serve.llm.engine_args.model`" in err and "not a whole safetensors file" in err


def test_weights_that_disagree_with_config_json_are_a_config_error_in_plan(capsys, tmp_path,
                                                                            llama_path):
    import json
    import shutil
    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    code, _, err = run(capsys, f"serve.llm.engine_args.model={model}")
    assert code == EXIT_CONFIG and "Traceback" not in err, err
    assert "`serve.llm.engine_args.model`" in err and "but config.json implies [" in err


def test_flagscale_engine_args_map_without_silent_choices():
    from flagserve.config import parse_config
    from flagserve.config.errors import ConfigError
    entry = {"serve_id": "m", "engine": "vllm",
             "engine_args": {"model": "/x", "port": 9010, "served_model_name": ["a", "b"]}}
    # the experiment's own default port is no conflict: the engine_args one is meant
    config, _ = parse_config({"experiment": {"runner": {"deploy": {"port": 8000}}},
                              "serve": [entry]})
    assert config.deploy.port == 9010
    assert config.serve["m"].model_name == ["a", "b"]  # vLLM serves every name
    with pytest.raises(ConfigError, match="conflicts with experiment.runner.deploy.port=9000"):
        parse_config({"experiment": {"runner": {"deploy": {"port": 9000}}}, "serve": [entry]})
    twice = {**entry, "engine_args": {"model": "/x", "max-num-seqs": 8, "max_num_seqs": 16}}
    with pytest.raises(ConfigError, match="sets max_num_seqs again"):
        parse_config({"serve": [twice]})


def test_a_model_name_that_is_another_modules_id_is_refused(capsys):
    code, _, err = run(capsys, "+serve.llm2={engine_args:{model:null},tiny_model:qwen2,"
                               "model_name:llm}")
    assert code == EXIT_CONFIG and "`serve.llm2.model_name`" in err
    assert "'llm' is also served by serve.llm" in err


@pytest.mark.parametrize("name", ["smollm2", "tiny"])
def test_the_builtin_configs_list_every_engine_arg_a_config_sets(name):
    """So that each overrides without a `+` (README, Configuration)."""
    written = yaml.safe_load((REPO / "conf" / "serve" / f"{name}.yaml").read_text())
    listed = written.get("serve", written)["llm"]["engine_args"]  # tiny.yaml: @package _global_
    graph_filled = {"kv_transfer", "placement_hosts"}
    assert set(listed) == {f.name for f in dataclasses.fields(EngineArgs)} - graph_filled


def test_the_schema_defaults_are_conf_serve_yaml_s():
    """An example config that leaves a section out gets what conf/serve.yaml documents."""
    written = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "serve.yaml"), resolve=False)
    defaults = dataclasses.asdict(parse_config({})[0])
    differ = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in a.keys() & b.keys():
                walk(a[key], b[key], f"{path}.{key}")
        elif a != b:
            differ.append(path)
    walk(written["experiment"], defaults["experiment"], "experiment")
    assert sorted(differ) == ["experiment.exp_dir", "experiment.exp_name"], differ


def test_load_format_reaches_the_engine_and_vllm_formats_are_noted():
    """auto | dummy are EngineArgs' own; vLLM's file formats (safetensors, pt) are noted and
    dropped: the engine reads the format the checkpoint has."""
    def module(value):
        engine_args = {"model": "/m", "load_format": value}
        config, notes = parse_config({"serve": {"llm": {"engine_args": engine_args}}})
        return config.llms["llm"].engine_args, notes
    args, notes = module("dummy")
    assert args["load_format"] == "dummy" and not notes
    args, notes = module("safetensors")
    assert "load_format" not in args and any("load_format=safetensors" in n for n in notes), notes


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*/conf/*.yaml")),
                         ids=lambda p: f"{p.parts[-3]}/{p.name}")
def test_example_configs_write_what_conf_serve_yaml_writes(path):
    """Hydra's settings of an example's main config are conf/serve.yaml's: a sweep with it
    writes under exp_dir, not a multirun/ folder in the working directory."""
    ours = yaml.safe_load((REPO / "conf" / "serve.yaml").read_text())["hydra"]
    assert yaml.safe_load(path.read_text())["hydra"] == ours
