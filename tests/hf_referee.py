"""HF transformers as the referee on token-id prompts: greedy tokens and their logprobs."""
from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprob of each token) of greedy generation from each prompt, EOS ignored.

    The attention mask is passed explicitly: without it generate() masks every prompt token
    equal to pad_token_id, and chat prompts contain it (SmolLM2 pads with <|im_end|>)."""
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [step[0].float().log_softmax(-1)[t].item() for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results
