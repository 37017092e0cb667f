"""What the sampler gets each step: per-row parameters as one array, built without a loop
per parameter (the sampling shard keeps each sequence's row from its first step on)."""
from dataclasses import dataclass, field

import numpy as np
import torch

from flagserve.engine.bad_words import banned_now
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.step_input import StepInput
from flagserve.layers.sampler import SamplingBatch

# Columns of a sequence's row: all floats (top_k up to 2**24 is exact in fp32).
TEMPERATURE, TOP_K, TOP_P, MIN_P, LOGPROBS, MIN_TOKENS = range(6)


@dataclass
class SeqSampling:
    """What the sampling shard keeps of a sequence between steps."""
    params: SamplingParams
    prompt_token_ids: list[int]  # empty unless penalties need them
    generator: torch.Generator | None  # seeded requests: survives preemption, dies with the seq
    row: tuple[float, ...] = field(init=False)
    plain: bool = field(init=False)  # greedy and nothing to apply or report: needs no row
    # logit_bias as (token ids, biases) tensors, built once rather than at every step
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(init=False)
    allowed: torch.Tensor | None = field(init=False)  # allowed_token_ids, as a tensor

    def __post_init__(self) -> None:
        p = self.params
        self.row = (p.temperature, p.top_k if p.top_k > 0 else 0, p.top_p, p.min_p,
                    -1 if p.logprobs is None else p.logprobs, p.min_tokens)
        self.plain = (p.temperature == 0 and p.logprobs is None and p.min_tokens == 0
                      and not p.logit_bias and p.allowed_token_ids is None
                      and not p.bad_words_token_ids)
        self.bias = None if not p.logit_bias else (
            torch.tensor(list(p.logit_bias), dtype=torch.long),
            torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
        self.allowed = (None if p.allowed_token_ids is None
                        else torch.tensor(p.allowed_token_ids, dtype=torch.long))


def sampling_batch(seqs: list[SeqSampling], step: StepInput, vocab_size: int,
                   eos_token_ids: tuple[int, ...], device: torch.device) -> SamplingBatch:
    """The batch of the rows that sample this step (`seqs`, in step.sample_indices order)."""
    if step.output_token_ids is None and all(s.plain for s in seqs):
        # The common case, greedy rows only: the argmax reads no per-row parameter.
        return SamplingBatch(None, None, None, None, all_greedy=True,
                             token_bitmask=step.grammar_bitmask())
    rows = np.array([s.row for s in seqs], dtype=np.float32)
    top_k_on = bool((rows[:, TOP_K] > 0).any())
    rows[rows[:, TOP_K] == 0, TOP_K] = vocab_size
    # One host-to-device copy for every per-row parameter.
    cols = torch.from_numpy(rows[:, :MIN_P + 1]).to(device, non_blocking=True)
    batch = SamplingBatch(
        temperatures=cols[:, TEMPERATURE],
        top_ks=cols[:, TOP_K].long() if top_k_on else None,
        top_ps=cols[:, TOP_P] if (rows[:, TOP_P] < 1).any() else None,
        min_ps=cols[:, MIN_P] if (rows[:, MIN_P] > 0).any() else None,
        all_greedy=bool((rows[:, TEMPERATURE] == 0).all()),
        max_num_logprobs=int(rows[:, LOGPROBS].max()),
    )
    params = [s.params for s in seqs]
    if step.output_token_ids is not None and any(p.has_penalties for p in params):
        penalties = torch.tensor([(p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
                                  for p in params], dtype=torch.float32).to(device)
        batch.repetition_penalties, batch.presence_penalties, batch.frequency_penalties = penalties.T
        batch.output_token_ids = step.output_token_ids
        batch.prompt_token_ids = [s.prompt_token_ids for s in seqs]
    batch.banned_token_ids = banned_token_ids(params, step, rows[:, MIN_TOKENS], eos_token_ids)
    batch.logit_bias = bias_triples(seqs, device)
    batch.allowed_token_ids = allowed_pairs(seqs, device)
    generators = {i: s.generator for i, s in enumerate(seqs) if s.generator is not None}
    batch.generators = generators or None
    batch.token_bitmask = step.grammar_bitmask()
    return batch


def bias_triples(seqs: list[SeqSampling], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows' logit_bias entries as (rows, token ids, biases), or None when no row has one."""
    biased = [(row, s.bias) for row, s in enumerate(seqs) if s.bias is not None]
    if not biased:
        return None
    rows, token_ids = _row_pairs([(row, ids) for row, (ids, _) in biased])
    biases = torch.cat([values for _, (_, values) in biased])
    return rows.to(device), token_ids.to(device), biases.to(device)


def banned_token_ids(params: list[SamplingParams], step: StepInput, min_tokens: np.ndarray,
                     eos_token_ids: tuple[int, ...]) -> list[list[int]] | None:
    """Per row, what it may not sample now: stop and EOS ids below min_tokens, and the tokens
    that would complete a bad word; None when no row bans anything."""
    below_min = np.asarray(step.num_output_tokens) < min_tokens
    if not below_min.any() and not any(p.bad_words_token_ids for p in params):
        return None  # the common case: no per-row work
    outputs = step.output_token_ids
    bans = []
    for row, p in enumerate(params):
        ban = (p.stop_token_ids + ([] if p.ignore_eos else list(eos_token_ids))) if below_min[row] else []
        if p.bad_words_token_ids:
            ban = ban + banned_now(p.bad_words_token_ids, None if outputs is None else outputs[row])
        bans.append(ban)
    return bans if any(bans) else None


def allowed_pairs(seqs: list[SeqSampling], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows' allowed_token_ids as (rows, token ids) with a [N] bool of the restricted rows,
    or None when no row restricts its tokens."""
    restricted = [(row, s.allowed) for row, s in enumerate(seqs) if s.allowed is not None]
    if not restricted:
        return None
    rows, token_ids = _row_pairs(restricted)
    mask = torch.zeros(len(seqs), dtype=torch.bool)
    mask[[row for row, _ in restricted]] = True
    return rows.to(device), token_ids.to(device), mask.to(device)


def _row_pairs(entries: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token id tensors as two flat tensors (row of each id, the ids)."""
    rows = torch.repeat_interleave(torch.tensor([row for row, _ in entries]),
                                   torch.tensor([len(ids) for _, ids in entries]))
    return rows, torch.cat([ids for _, ids in entries])
