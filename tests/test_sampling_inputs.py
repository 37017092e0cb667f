"""The sampler's per-row inputs, built from each sequence's cached row in one array."""
import torch

from flagserve import SamplingParams
from flagserve.engine.sampling_inputs import SeqSampling, sampling_batch
from flagserve.engine.step_input import StepInput

VOCAB, EOS = 50, (2,)


def batch_of(params, num_output_tokens, penalties=False):
    seqs = [SeqSampling(p, [1, 2], None) for p in params]
    n = len(params)
    step = StepInput(list(range(n)), [1] * n, [0] * n, [[0]] * n, [5] * n, list(range(n)),
                     num_output_tokens, [[3]] * n if penalties else None)
    return sampling_batch(seqs, step, VOCAB, EOS, torch.device("cpu"))


def test_all_greedy_needs_no_filters():
    b = batch_of([SamplingParams(temperature=0)] * 3, [0, 0, 0])
    assert b.all_greedy and b.max_num_logprobs == -1
    assert b.top_ks is None and b.top_ps is None and b.min_ps is None
    assert b.banned_token_ids is None and b.repetition_penalties is None and b.generators is None


def test_mixed_rows():
    params = [SamplingParams(temperature=0, logprobs=3, min_tokens=2, stop_token_ids=[7]),
              SamplingParams(temperature=0.5, top_k=5, top_p=0.8, min_p=0.1, logprobs=0),
              SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.25)]
    b = batch_of(params, [1, 0, 4], penalties=True)
    assert not b.all_greedy and b.max_num_logprobs == 3
    assert b.temperatures.tolist() == [0, 0.5, 1.0]
    assert b.top_ks.dtype == torch.long and b.top_ks.tolist() == [VOCAB, 5, VOCAB]
    assert b.top_ps.tolist() == [1.0, 0.800000011920929, 1.0]
    assert b.min_ps.tolist() == [0, 0.10000000149011612, 0]
    assert b.banned_token_ids == [[7, 2], [], []]  # only row 0 is below its min_tokens
    assert b.repetition_penalties.tolist() == [1, 1, 1.2000000476837158]
    assert b.presence_penalties.tolist() == [0, 0, 0.5]
    assert b.frequency_penalties.tolist() == [0, 0, 0.25]
    assert b.prompt_token_ids == [[1, 2]] * 3 and b.output_token_ids == [[3]] * 3


def test_plain_greedy_rows_skip_the_parameter_array():
    """Greedy rows without logprobs or min_tokens need no per-row tensors; any other row in
    the batch (or penalties) brings the full batch back."""
    plain = batch_of([SamplingParams(temperature=0)] * 2, [0, 0])
    assert plain.all_greedy and plain.temperatures is None and plain.max_num_logprobs == -1
    for other in (SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0, min_tokens=1),
                  SamplingParams(temperature=0.7)):
        full = batch_of([SamplingParams(temperature=0), other], [0, 0])
        assert full.temperatures is not None, other
    assert batch_of([SamplingParams(temperature=0)] * 2, [0, 0], penalties=True).temperatures is not None
