"""Small helpers shared by the Triton wrappers (imported only when Triton is used)."""
import functools

import torch
import triton

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp2 is one instruction, exp is not


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 8 on CPU (interpreter runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@functools.cache
def has_tma(device: torch.device) -> bool:
    """The GPU has the tensor memory accelerator (Hopper, sm_90, and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep IEEE products (tf32 would cost ~1e-3 relative error); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take arbitrary outer strides but assume unit stride along the last dim."""
    return x if x.stride(-1) == 1 else x.contiguous()
