"""The model architectures FlagServe serves: the one list that config.json and GGUF
parsing, the tiny-model builder and the serve config's `tiny_model` all read.

Kept free of torch so that config validation can import it cheaply.
"""
from typing import Literal, get_args

# By HF model_type: how tiny_model and `python -m flagserve.models.tiny --arch` name them.
Arch = Literal["llama", "mistral", "qwen2", "qwen3"]
ARCHS: tuple[Arch, ...] = get_args(Arch)
# By the class name a checkpoint's config.json lists under `architectures`. All of them are
# the one DecoderForCausalLM; their differences are flags of ModelConfig.
HF_ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# By a GGUF file's `general.architecture`. llama.cpp writes Mistral checkpoints as "llama"
# (same tensors, q/k permuted the same way), so there is no "mistral" here.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
