"""The hostfile parser (FlagScale's format) and the placement it feeds."""
from __future__ import annotations

import pytest

from flagserve.config import parse_config
from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host, HostfileError, parse_hostfile, parse_hostfile_text
from flagserve.runner.placement import place, stage_hosts


def test_flagscale_format_with_comments_and_options(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# head first\n\n10.0.0.1 slots=8 type=gpu   # the head\n"
                    "10.0.0.2 slots=8 type=A100 ssh_port=2222 user=ubuntu\n"
                    "   \nnode3 slots=16 type=CPU\n")
    assert parse_hostfile(path) == [
        Host("10.0.0.1", 8, "gpu"),
        Host("10.0.0.2", 8, "A100", 2222, "ubuntu"),
        Host("node3", 16, "cpu"),
    ]
    hosts = parse_hostfile(path)
    assert [h.num_gpus for h in hosts] == [8, 8, 0]  # type=NAME is an accelerator: GPUs


def test_type_defaults_to_gpu():
    assert parse_hostfile_text("10.0.0.1 slots=2") == [Host("10.0.0.1", 2, "gpu")]


@pytest.mark.parametrize("text, message", [
    ("10.0.0.1 slots=8\n10.0.0.1 slots=4",
     "hosts.txt:2: '10.0.0.1 slots=4': duplicate host 10.0.0.1 (first listed on line 1)"),
    ("10.0.0.1", "hosts.txt:1: '10.0.0.1': needs slots=N"),
    ("10.0.0.1 slots=0", "needs slots=N with N >= 1"),
    ("10.0.0.1 slots=x", "needs slots=N"),
    ("10.0.0.1 slots=8 gpus=2", "got 'gpus=2'"),
    ("10.0.0.1 slots=8 type", "got 'type'"),
    ("10.0.0.1 slots=8 slots=4", "slots= given twice"),
    ("10.0.0.1 slots=8 ssh_port=99999", "ssh_port must be a TCP port"),
    ("10.0.0.1 slots=8 ssh_port=ssh", "ssh_port must be a TCP port"),
    ("slots=8 10.0.0.1", "'slots=8' is not a host address"),
    ("10.0.0.1 slots=8 user=a;b", "user='a;b' is not a simple name"),
    ("# only comments\n\n", "lists no hosts"),
    # a port in the address went on to fail at SSH connect; it belongs in ssh_port=
    ("10.250.31.2:2222 slots=1", "'10.250.31.2:2222': a port does not go in the address; "
                                 "write `10.250.31.2 ... ssh_port=2222`"),
    ("node2:22 slots=1", "write `node2 ... ssh_port=22`"),
    # host names and IPv4 addresses that differ in spelling only are the same host
    ("Host-A slots=1\nhost-a slots=1", "hosts.txt:2: 'host-a slots=1': duplicate host host-a "
                                      "(first listed on line 1)"),
    ("999.1.1.1 slots=1", "'999.1.1.1' is not an IPv4 address (Octet 999 (> 255)"),
    ("10.0.0.01 slots=1", "'10.0.0.01' is not an IPv4 address (Leading zeros"),
    ("10.0.0 slots=1", "'10.0.0' is not an IPv4 address"),
    # IPv6 went unbracketed into `ray start --address=fd00::1:6379` (or was "not a host
    # address"): refused alike, whatever the spelling
    ("fd00::1 slots=1", "'fd00::1': IPv6 addresses are not supported; use the host's IPv4"),
    ("::1 slots=1", "'::1': IPv6 addresses are not supported"),
    ("[fe80::1] slots=1", "'[fe80::1]': IPv6 addresses are not supported"),
    ("[fd00::1]:22 slots=1", "IPv6 addresses are not supported"),
])
def test_errors_name_the_line(text, message):
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, "hosts.txt")
    assert "hosts.txt" in str(err.value)
    assert message in str(err.value)


def test_bad_hostfile_is_a_config_error_naming_the_line(tmp_path):
    from flagserve.runner.cli import inventory
    path = tmp_path / "hostfile"
    path.write_text("10.0.0.1 slots=8\n10.0.0.2 slots=eight\n")
    config, _ = parse_config({"experiment": {"runner": {"hostfile": str(path)}}})
    with pytest.raises(ConfigError) as err:
        inventory(config)
    assert err.value.key == "experiment.runner.hostfile"
    assert f"{path}:2: '10.0.0.2 slots=eight'" in err.value.message


def _config(tp: int, pp: int, device: str = "cuda", replicas: int = 1):
    config, _ = parse_config({
        "experiment": {"runner": {"hostfile": "hosts.txt"}},
        "serve": {"llm": {"engine_args": {"model": "/m", "device": device,
                                          "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
                          "resources": {"num_replicas": replicas}}}})
    return config


def test_placement_packs_tp_on_a_host_and_spans_pp_in_host_order():
    hosts = parse_hostfile_text("10.0.0.1 slots=8\n10.0.0.2 slots=8\n")
    shards = place(_config(8, 2), hosts)
    assert [(s.stage, s.host, s.devices) for s in shards] == [
        (0, "10.0.0.1", list(range(8))), (1, "10.0.0.2", list(range(8)))]
    assert stage_hosts(_config(8, 2), hosts, "llm") == ["10.0.0.1", "10.0.0.2"]
    shards = place(_config(4, 2, replicas=2), hosts)
    assert [(s.replica, s.stage, s.host, s.devices) for s in shards] == [
        (0, 0, "10.0.0.1", [0, 1, 2, 3]), (0, 1, "10.0.0.1", [4, 5, 6, 7]),
        (1, 0, "10.0.0.2", [0, 1, 2, 3]), (1, 1, "10.0.0.2", [4, 5, 6, 7])]
    # replicas placed differently: one Serve deployment cannot pin them, Ray packs instead
    assert stage_hosts(_config(4, 2, replicas=2), hosts, "llm") is None


def test_placement_on_cpu_hosts_uses_slots_and_reports_overflow():
    hosts = parse_hostfile_text("10.0.0.1 slots=1 type=cpu\n10.0.0.2 slots=1 type=cpu\n")
    assert stage_hosts(_config(1, 2, "cpu"), hosts, "llm") == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(ConfigError) as err:
        place(_config(2, 1, "cpu"), hosts)
    assert "needs 2 CPU slots" in err.value.message


def test_two_node_example_plans_tp8_pp2(tmp_path):
    """examples/qwen2_5/conf/two_nodes.yaml: hosts, stages and the endpoint on the head."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    model = tmp_path / "qwen72b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 8192,
        "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}))
    result = subprocess.run(
        [sys.executable, "run.py", "--config-path", "examples/qwen2_5/conf", "--config-name",
         "two_nodes", f"experiment.exp_dir={tmp_path / 'exp'}", "action=plan"],
        cwd=repo, capture_output=True, text=True, timeout=120,
        env={**os.environ, "QWEN72_PATH": str(model)})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "host 10.0.0.1               Ray head + serving process, 8 GPU(s)" in out
    assert "TP 8 x PP 2" in out and "OpenAI API at http://10.0.0.1:8000/v1" in out
    assert "replica 0 stage 0: 10.0.0.1 gpu 0,1,2,3,4,5,6,7" in out
    assert "replica 0 stage 1: 10.0.0.2 gpu 0,1,2,3,4,5,6,7" in out
