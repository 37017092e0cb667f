"""The sampler's ops on a batch's logits, the reference for every device; CPU engines run the
native kernels (csrc/cpu_sampling.cpp).

- A grammar's token bitmask: -inf where a row's bit is 0 (bit j of word w is token 32 * w + j,
  xgrammar's layout).
- The index of each row's largest value, the first on ties (greedy rows, and the exponential
  race of sampled ones).
- Each row's log-sum-exp and the rank of a given token in it (1 = the largest): logprobs.
"""
import torch


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def lse_and_ranks_torch(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp [N], rank of tokens[i] in row i [N] int64) of float32 logits [N, V]."""
    own = logits.gather(1, tokens[:, None])
    return logits.logsumexp(-1), (logits > own).sum(-1) + 1

_BIAS_TABLES: dict[torch.device, torch.Tensor] = {}


def _bias_table(device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where bit j is set and -inf where it is not."""
    if device not in _BIAS_TABLES:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _BIAS_TABLES[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    return _BIAS_TABLES[device]


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Each mask byte looks up its 8 biases and one add applies them: masked_fill and
    xgrammar's CPU kernel take 10x longer."""
    # Little-endian words (x86, ARM, CUDA): byte k of word w holds tokens 32 * w + 8 * k + j.
    as_bytes = bitmask.to(logits.device, non_blocking=True).view(torch.uint8).flatten()
    bias = _bias_table(logits.device).index_select(0, as_bytes.int())
    return logits + bias.view(bitmask.shape[0], -1)[:, :logits.shape[-1]]
