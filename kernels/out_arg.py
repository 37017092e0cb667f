"""The attention ops' optional `out`: a mixed step's decodes and prefill chunks write into the
two halves of one tensor (layers/attention.py) instead of each op returning its own tensor for
the caller to copy, a copy the size of q in every layer. Implementations that can only return
a new tensor (the native CPU ops, the reference's small-batch path) copy it in here."""
import torch


def written(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
