"""Build a model from a local HF directory: config, architecture lookup, safetensors weights."""
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.models.config import ModelConfig
from flagserve.models.decoder import DecoderForCausalLM
from kernels import KernelOps

# Every supported architecture is one decoder; the table is where a new family would go.
MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    return files


def iterate_weights(model_dir: Path, keep: Callable[[str], bool] = lambda name: True
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor `keep` wants; the others are never read."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, cfg: ModelConfig, ops: KernelOps, dtype: torch.dtype,
               device: torch.device, par: ParallelContext = ParallelContext()) -> DecoderForCausalLM:
    """This shard's part of the model (all of it with TP = PP = 1), its weights only."""
    model_cls = MODEL_CLASSES[cfg.architecture]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg, ops, par)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(iterate_weights(Path(model_dir), model.owns_weight))
    return model.eval()
