"""Activations between pipeline stages: hidden states and residual, one point-to-point send.

Every TP rank of a stage holds the full (all-reduced) hidden states, so TP rank r of stage s
sends to TP rank r of stage s + 1 and no stage needs a gather or scatter.
"""
import torch
import torch.distributed as dist


def send_activations(hidden: torch.Tensor, residual: torch.Tensor, dst: int) -> None:
    dist.send(torch.stack((hidden, residual)), dst)


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                     src: int) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf[0], buf[1]
