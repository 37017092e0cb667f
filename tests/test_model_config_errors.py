"""A checkpoint whose config.json and weights disagree, or whose config lacks a field, is one
ValueError naming what is wrong (transformers refuses the same directories), never a model
that loads with its weights cut to fit."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flagserve import LLM
from flagserve.models.config import load_model_config


def variant(src: str, dst, config_edit=None, weights_edit=None) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if weights_edit:
        weights = load_file(dst / "model.safetensors")
        weights_edit(weights)
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


CASES = {  # name: (config edit, weights edit, what the error says: the tensor, both shapes)
    "narrower intermediate_size": (
        lambda c: c.update(intermediate_size=96), None,
        r"'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \[(128, 64|64, 128)\], but "
        r"the model's config implies \[(96, 64|64, 96)\]"),
    "larger vocab_size": (
        lambda c: c.update(vocab_size=1600), None,
        r"'(model\.embed_tokens|lm_head)\.weight' has shape \[1536, 64\], but the model's config "
        r"implies \[1600, 64\]"),
    "a norm of one value": (
        None, lambda w: w.update({"model.norm.weight": torch.ones(1)}),
        r"'model\.norm\.weight' has shape \[1\], but the model's config implies \[64\]"),
}


@pytest.mark.parametrize("case", CASES)
def test_weights_that_disagree_with_the_config_are_refused(case, llama_path, tmp_path):
    config_edit, weights_edit, words = CASES[case]
    path = variant(llama_path, tmp_path / "model", config_edit, weights_edit)
    with pytest.raises(ValueError, match=words):
        LLM(path, dtype="float32")


def test_a_missing_config_field_is_named(llama_path, tmp_path):
    path = variant(llama_path, tmp_path / "model", lambda c: c.pop("intermediate_size"))
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        load_model_config(path)


def test_a_sliding_window_limit_says_so(tiny_model_factory):
    path = tiny_model_factory("mistral", sliding_window=32)
    with pytest.raises(ValueError, match="exceeds the model's 32 positions \\(its sliding window"):
        LLM(path, dtype="float32", max_model_len=64)
