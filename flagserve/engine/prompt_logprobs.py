"""prompt_logprobs: how the model scores each prompt token, from the rows prefill computes anyway.

The logits of position p score prompt token p + 1, so a chunk of prompt rows [start, start + n)
scores tokens start + 1 .. start + n (the last prompt row's logits sample the first output
token instead). Only the request's first sequence scores; its rows are never served from the
prefix cache (BlockManager.match_prefix) and, recomputed after a preemption, rows already
scored are not scored again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flagserve.engine.outputs import logprob_entry
from flagserve.engine.sequence import Sequence
from flagserve.layers.sampler import PromptScores, logprobs_of

# float32 logits scored at once (128 MiB): a 4k-row chunk of a 150k vocabulary would be 2.4 GiB
LOGITS_PER_PASS = 2**25


@dataclass
class PromptRows:
    """The rows of one sequence's chunk that score its prompt, in the step's flat batch."""
    seq_id: int
    first_row: int
    targets: list[int]  # the prompt tokens they score, one per row
    num_top: int


def prompt_rows(seq: Sequence, start: int, num_new: int, first_row: int) -> PromptRows | None:
    """The rows of seq's chunk [start, start + num_new) (at first_row) still to score, if any."""
    scored = seq.prompt_logprobs
    if scored is None:
        return None
    lo = max(start, len(scored) - 1)  # entry 0 (the first token) scores nothing
    hi = min(start + num_new, seq.num_prompt_tokens - 1)
    if lo >= hi:
        return None
    return PromptRows(seq.seq_id, first_row + lo - start, seq.token_ids[lo + 1:hi + 1],
                      seq.params.prompt_logprobs)


@torch.inference_mode()
def score_prompt_rows(hidden: torch.Tensor, rows: list[PromptRows],
                      compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                      vocab_size: int, lse_and_ranks: Callable) -> list[PromptScores] | None:
    """Every rank of the last stage runs the LM head (a TP group gathers its logits); only
    the rank that gets them (the sampling shard) returns scores."""
    device = hidden.device
    index = torch.tensor([r.first_row + i for r in rows for i in range(len(r.targets))], device=device)
    targets = torch.tensor([t for r in rows for t in r.targets], device=device)
    num_top = max(r.num_top for r in rows)
    per_pass = max(1, LOGITS_PER_PASS // vocab_size)
    parts = []
    for lo in range(0, len(index), per_pass):
        logits = compute_logits(hidden[index[lo:lo + per_pass]])
        if logits is not None:
            parts.append(logprobs_of(logits.float(), targets[lo:lo + per_pass], num_top, lse_and_ranks))
    if not parts:
        return None
    chosen, ranks, top_ids, top_lps = (None if t[0] is None else torch.cat(t).tolist() for t in zip(*parts))
    out, at = [], 0
    for r in rows:
        end = at + len(r.targets)
        tops = (None, None) if not r.num_top else ([ids[:r.num_top] for ids in top_ids[at:end]],
                                                   [lps[:r.num_top] for lps in top_lps[at:end]])
        out.append(PromptScores(r.seq_id, chosen[at:end], ranks[at:end], *tops))
        at = end
    return out


def record_prompt_scores(seq: Sequence, scores: PromptScores, decode: Callable[[int], str | None]) -> None:
    """Append the scored tokens' entries (token ids from the prompt itself)."""
    first = len(seq.prompt_logprobs)
    for i, (logprob, rank) in enumerate(zip(scores.logprobs, scores.ranks)):
        tops = None if scores.top_token_ids is None else (scores.top_token_ids[i], scores.top_logprobs[i])
        seq.prompt_logprobs.append(logprob_entry(seq.token_ids[first + i], logprob, rank, tops, decode))
