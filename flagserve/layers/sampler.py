"""Turns the last-token logits of a batch into next tokens, per-row sampling parameters.

logit_bias and penalties act on the logits, then the masks: bans (min_tokens, bad_words),
allowed_token_ids and a grammar's allowed tokens (a -inf commutes with a bias or a penalty,
so this is vLLM's result). Greedy rows take the argmax; random rows apply temperature, top-k,
top-p and min-p and draw with the exponential race (argmax of p / Exp(1) noise), whose noise
comes from the row's own generator when the request has a seed, so its draws do not depend on
what else is in the batch. Reported logprobs are those of the raw model distribution.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import KernelOps
from kernels.sampling import apply_token_bitmask_torch, argmax_torch, lse_and_ranks_torch


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor | None  # [N] fp32, 0 = greedy; None when all_greedy
    top_ks: torch.Tensor | None  # [N] int64, vocab size where off; None when no row uses it
    top_ps: torch.Tensor | None  # [N] fp32
    min_ps: torch.Tensor | None  # [N] fp32
    all_greedy: bool
    # Penalties (None when no row uses them)
    presence_penalties: torch.Tensor | None = None  # [N]
    frequency_penalties: torch.Tensor | None = None  # [N]
    repetition_penalties: torch.Tensor | None = None  # [N]
    output_token_ids: list[list[int]] | None = None
    prompt_token_ids: list[list[int]] | None = None
    banned_token_ids: list[list[int]] | None = None  # per row: min_tokens' stop/EOS ids, bad words
    generators: dict[int, torch.Generator] | None = None  # row -> seeded generator
    max_num_logprobs: int = -1  # -1: no row asked for logprobs; 0: only the sampled token's
    token_bitmask: torch.Tensor | None = None  # [N, ceil(vocab / 32)] int32: allowed tokens (grammars)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    # allowed_token_ids: (rows, token ids) pairs and a [N] bool of the rows they restrict
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class PromptScores:
    """prompt_logprobs of one sequence's rows in a step: how the model scored its next prompt
    tokens (the logits of position p score token p + 1)."""
    seq_id: int
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token, when logprobs were asked for
    ranks: list[int] | None  # of each sampled token, when logprobs were asked for
    top_token_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    prompt_scores: list[PromptScores] | None = None  # rows that score the prompt, not sampled

    def select(self, rows: list[int]) -> "SamplerOutput":
        """These rows only, in this order."""
        def pick(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in rows]
        return SamplerOutput(pick(self.token_ids), pick(self.logprobs), pick(self.ranks),
                             pick(self.top_token_ids), pick(self.top_logprobs), self.prompt_scores)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, num_top: int,
                lse_and_ranks: Callable = lse_and_ranks_torch
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per row of float32 `logits`: the logprob of its token, that token's rank (1 = the most
    likely) and, when num_top > 0, the top num_top (ids, logprobs). Ranks and the top are the
    logits' own; only the values picked subtract the row's log-sum-exp: no [rows, vocab]
    log-softmax is written (a prompt scores thousands of rows)."""
    lse, ranks = lse_and_ranks(logits, tokens)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1)
    if num_top <= 0:
        return chosen - lse, ranks, None, None
    top = logits.topk(num_top, dim=-1)
    return chosen - lse, ranks, top.indices, top.values - lse[:, None]


@dataclass
class DeviceSamples:
    """A step's samples where the sampler left them; host() brings them over (the step's one
    wait for the device). After start_copy() the copy runs behind the device's queue and
    host() waits only for it, so the host can prepare the next step meanwhile."""
    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] (with ranks: when logprobs were asked for)
    ranks: torch.Tensor | None = None  # [N]
    top_ids: torch.Tensor | None = None  # [N, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None
    _copied: object | None = None  # a CUDA event after start_copy

    FIELDS = ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs")  # SamplerOutput's order

    def start_copy(self) -> "DeviceSamples":
        if self.tokens.is_cuda:  # to pinned host memory (non_blocking allocates it pinned)
            for name in self.FIELDS:
                if (t := getattr(self, name)) is not None:
                    setattr(self, name, t.to("cpu", non_blocking=True))
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self

    def host(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        values = (getattr(self, name) for name in self.FIELDS)
        return SamplerOutput(*(None if t is None else t.tolist() for t in values))


def _token_mask(rows: list[list[int]], vocab_size: int, device: torch.device,
                counts: bool = False) -> torch.Tensor:
    """[N, vocab] occurrence counts (or a bool mask) of each row's token ids."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width + 1), vocab_size, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    out = torch.zeros(len(rows), vocab_size + 1, device=device)
    out.scatter_add_(1, ids.to(device), torch.ones_like(ids, dtype=out.dtype, device=device))
    out = out[:, :vocab_size]
    return out if counts else out > 0


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each (row, token, bias) triple added to its logit (out of place: the logits may be
    the model's own tensor)."""
    rows, token_ids, biases = batch.logit_bias
    return logits.index_put((rows, token_ids), biases, accumulate=True)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    if batch.repetition_penalties is not None:
        seen = _token_mask([p + o for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)],
                           vocab, logits.device)
        penalty = torch.where(seen, batch.repetition_penalties[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.presence_penalties is not None:
        counts = _token_mask(batch.output_token_ids, vocab, logits.device, counts=True)
        logits = logits - batch.frequency_penalties[:, None] * counts
        logits = logits - batch.presence_penalties[:, None] * (counts > 0)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_ps is not None:
        probs = logits.softmax(-1)
        threshold = batch.min_ps[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_ks is None and batch.top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if batch.top_ks is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= batch.top_ks[:, None], float("-inf"))
    if batch.top_ps is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the top token always survives
        sorted_logits.masked_fill_(mass_before > batch.top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_allowed_token_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Restricted rows keep only their allowed tokens' logits (out of place)."""
    rows, token_ids, restricted = batch.allowed_token_ids
    kept = torch.full_like(logits, float("-inf"))
    kept[rows, token_ids] = logits[rows, token_ids]
    return torch.where(restricted[:, None], kept, logits)


def apply_bans_and_grammar(logits: torch.Tensor, batch: SamplingBatch,
                           apply_token_bitmask: Callable = apply_token_bitmask_torch) -> torch.Tensor:
    """Bans (min_tokens, bad words), then allowed_token_ids, then the grammar, each a hard
    limit over the one before: where one leaves a row nothing (a grammar or an allowed set that
    may only end, and EOS banned), the rows' earlier limits give way, as a token outside it
    would break the output."""
    before = logits
    if batch.banned_token_ids is not None:
        logits = logits.clone()
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
    if batch.allowed_token_ids is not None:
        banned, before = logits, apply_allowed_token_ids(before, batch)
        logits = _unless_empty(apply_allowed_token_ids(banned, batch), before)
    if batch.token_bitmask is None:
        return logits
    masked = apply_token_bitmask(logits, batch.token_bitmask)
    if batch.banned_token_ids is None and batch.allowed_token_ids is None:
        return masked
    return _unless_empty(masked, apply_token_bitmask(before, batch.token_bitmask))


def _unless_empty(limited: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`limited`'s rows, but `fallback`'s where `limited` left a row no token."""
    return torch.where(torch.isneginf(limited).all(-1, keepdim=True), fallback, limited)


def exponential_noise(shape: tuple[int, int], generators: dict[int, torch.Generator] | None,
                      device: torch.device, default: torch.Generator) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    if not generators:
        return noise.exponential_(generator=default)
    for row in range(shape[0]):
        noise[row].exponential_(generator=generators.get(row, default))
    return noise


def plain_greedy(batch: SamplingBatch, grammar: bool = False) -> bool:
    """Every row greedy with nothing to apply first (but a grammar's mask, where `grammar`) and
    no logprobs to report."""
    return (batch.all_greedy and batch.max_num_logprobs < 0 and (grammar or batch.token_bitmask is None)
            and batch.banned_token_ids is None and batch.logit_bias is None
            and batch.allowed_token_ids is None
            and batch.repetition_penalties is None
            and batch.presence_penalties is None and batch.frequency_penalties is None)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator started from `seed`. The CPU one (mt19937) keeps only the low 32 bits of
    its seed, which made 5 and 5 + 2**32 draw the same numbers: there the high half is
    multiplied by an odd constant (a bijection) into the low one, so seeds that differ
    only above bit 31 differ, and seeds below 2**32 keep their numbers."""
    if device.type == "cpu":
        bits = seed & (2**64 - 1)  # a negative seed as torch reads it
        seed = (bits & 0xFFFFFFFF) ^ ((bits >> 32) * 0x9E3779B9 & 0xFFFFFFFF)
    return torch.Generator(device=device).manual_seed(seed)


class Sampler(nn.Module):
    def __init__(self, seed: int, device: torch.device, ops: KernelOps | None = None):
        super().__init__()
        self.apply_token_bitmask = ops.apply_token_bitmask if ops else apply_token_bitmask_torch
        self.argmax = ops.argmax if ops else argmax_torch
        self.lse_and_ranks = ops.lse_and_ranks if ops else lse_and_ranks_torch
        self.generator = seeded_generator(seed, device)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).host()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSamples:
        """The samples, left on the device (no wait for it)."""
        if plain_greedy(batch):
            # Widening to fp32 is exact, so the argmax of the model-dtype logits is that of
            # their fp32 copy: skip the copy.
            return DeviceSamples(self.argmax(logits))
        logits = logits.float()
        want_logprobs = batch.max_num_logprobs >= 0
        raw = logits  # logprobs are of the raw distribution (every change below is out of place)
        if batch.logit_bias is not None:  # before the penalties, as vLLM
            logits = apply_logit_bias(logits, batch)
        if batch.repetition_penalties is not None or batch.presence_penalties is not None:
            logits = apply_penalties(logits, batch)
        logits = apply_bans_and_grammar(logits, batch, self.apply_token_bitmask)
        tokens = self.argmax(logits)
        if not batch.all_greedy:
            temps = batch.temperatures.clamp_min(1e-5)[:, None]
            probs = apply_top_k_top_p_min_p(logits / temps, batch).softmax(-1)
            noise = exponential_noise(tuple(probs.shape), batch.generators, probs.device, self.generator)
            sampled = self.argmax(probs / noise)
            tokens = torch.where(batch.temperatures == 0, tokens, sampled)
        if not want_logprobs:
            return DeviceSamples(tokens)
        return DeviceSamples(tokens, *logprobs_of(raw, tokens, batch.max_num_logprobs, self.lse_and_ranks))
