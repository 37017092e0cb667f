"""Build a model from its checkpoint: a local HF directory's safetensors, or a GGUF file."""
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.models.config import ModelConfig, model_format
from flagserve.models.decoder import DecoderForCausalLM
from kernels import KernelOps


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    return files


class CheckpointTensor:
    """A safetensors tensor read on demand: a tensor-parallel shard's narrow() or row slice
    reads only the bytes it keeps, so no rank ever holds a whole tensor it splits."""

    def __init__(self, lazy_slice):
        self._slice = lazy_slice
        self.shape = tuple(lazy_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """Rows [start:stop] along dim 0 (clamped like a tensor's slice), or all with [:]."""
        start, stop, _ = rows.indices(self.shape[0])
        return self._slice[start:max(start, stop)]


def iterate_weights(model_dir: Path, keep: Callable[[str], bool] = lambda _: True
                    ) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, lazy tensor) of every checkpoint tensor `keep` wants; the others are never read.
    A weight loader reads a tensor with narrow(), a row slice, or [:] for all of it."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                if keep(name):
                    yield name, CheckpointTensor(f.get_slice(name))


def checkpoint_weights(model: str | Path, keep: Callable[[str], bool]
                       ) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """(HF name, tensor) of the checkpoint's tensors `keep` wants, whatever the format. GGUF
    tensors are dequantized whole (quantized blocks cannot be sliced by column); the weight
    loader then keeps its TP slice."""
    if model_format(model) == "gguf":
        from flagserve.models.gguf import gguf_tensors  # gguf + numpy: only for a .gguf model
        return ((name, torch.from_numpy(values)) for name, values in gguf_tensors(model, keep))
    return iterate_weights(Path(model), keep)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def init_random_weights_(model: torch.nn.Module, seed: int = 0,
                         checkpoint_dtype: torch.dtype | None = None) -> None:
    """Random weights drawn on the model's device (vLLM's load_format="dummy"): every matrix
    N(0, 0.02), norm gains and biases as built (1 and 0). For benchmarks: no file to read.
    checkpoint_dtype: the values rounded to it, as a checkpoint of that dtype holds them (a
    bf16 model run in float32 has bf16 values, which the CPU kernels store in bf16)."""
    for p in model.parameters():
        if p.dim() >= 2:
            gen = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, 0.02, generator=gen)
            if checkpoint_dtype is not None and checkpoint_dtype != p.dtype:
                p.copy_(p.to(checkpoint_dtype))
            seed += 1


def load_model(model: str | Path, cfg: ModelConfig, ops: KernelOps, dtype: torch.dtype,
               device: torch.device, par: ParallelContext = ParallelContext(),
               random_weights: bool = False) -> DecoderForCausalLM:
    """This shard's part of the model (all of it with TP = PP = 1), its weights only.
    `model`: an HF model directory or a .gguf file (only its config with random_weights)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            decoder = DecoderForCausalLM(cfg, ops, par)  # serves every architecture in architectures.py
    finally:
        torch.set_default_dtype(default_dtype)
    if random_weights:
        init_random_weights_(decoder, checkpoint_dtype=DTYPES.get(cfg.torch_dtype))
    else:
        decoder.load_weights(checkpoint_weights(model, decoder.owns_weight))
    return decoder.eval()
