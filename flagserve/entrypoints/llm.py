"""The offline API users know from vLLM: LLM(model=...).generate(prompts, sampling_params)."""
import copy
import logging
from collections.abc import Sequence as Seq
from dataclasses import replace
from itertools import count

import torch
from tqdm.auto import tqdm

from flagserve.config.flagscale import vllm_only
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.llm_engine import LLMEngine
from flagserve.engine.outputs import RequestOutput
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams
from flagserve.entrypoints.openai.template_input import template_message
from flagserve.entrypoints.openai.tokenizer import ChatOptions, PromptTokenizer

# A string, token ids, or vLLM's TextPrompt / TokensPrompt dicts (engine/prompts.py).
Prompt = str | list[int] | dict
log = logging.getLogger(__name__)


def _no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not served; pass None")


class LLM:
    def __init__(self, model: str, **engine_args):
        """`engine_args`: EngineArgs' fields; vLLM's that change nothing here (flagscale.py
        vllm_only: trust_remote_code, swap_space, quantization=None, ...) are dropped with a
        warning, as a FlagScale YAML's are."""
        dropped = sorted(k for k, v in engine_args.items() if vllm_only(k, v))
        if dropped:
            log.warning("ignoring vLLM-only engine args: %s", ", ".join(dropped))
        args = {k: v for k, v in engine_args.items() if k not in dropped}
        self.llm_engine = LLMEngine(EngineArgs(model=model, **args))
        self._ids = count()
        self._chats: dict[str | None, PromptTokenizer] = {}  # by chat template, made on first use

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the cached prefixes (new weights, a cold-cache benchmark); False, and
        nothing done, while a request holds KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given none: the model's
        generation_config.json (temperature, top_p, top_k, min_p, the penalties, max_new_tokens)
        over SamplingParams' defaults, as vLLM's (EngineArgs.generation_config "vllm": those
        defaults alone)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: None = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a string, token ids, or
        a dict {"prompt": text} / {"prompt_token_ids": ids} as vLLM's. `priority`: one per
        prompt, lower scheduled earlier (scheduling_policy="priority")."""
        _no_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        engine = self.llm_engine
        order: dict[str, int] = {}
        # The CPU engine's thread tuner sets torch's count (process-wide) every step: the
        # caller's comes back after, for its own work and a later LLM's start.
        threads = torch.get_num_threads()
        try:
            for i, (prompt, params, rank) in enumerate(zip(prompts, sampling_params, priority)):
                request_id = str(next(self._ids))  # vLLM's: "0", "1", ...
                final = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, final, priority=rank)
                order[request_id] = i
            results: list[RequestOutput | None] = [None] * len(prompts)
            with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while any(r is None for r in results):
                    for out in engine.step():
                        if out.request_id in order:  # not another caller's of llm_engine
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                engine.abort(request_id)
            raise
        finally:
            torch.set_num_threads(threads)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: None = None, chat_template: str | None = None,
             *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template (or
        `chat_template`), as the server renders /v1/chat/completions' (vLLM's arguments; tool
        calls are not parsed). Each output's `prompt` is the rendered text."""
        _no_lora(lora_request)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        options = ChatOptions(add_generation_prompt, continue_final_message, kwargs or None,
                              describe_tools=bool(tools))
        renderer = self._chat_renderer(chat_template)
        prompts = []
        for conv in conversations:
            text, ids = renderer.render_chat([template_message(m) for m in conv], options)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_renderer(self, chat_template: str | None) -> PromptTokenizer:
        """The tokenizer's template, or the caller's on a copy of it (its probes are its own)."""
        if chat_template not in self._chats:
            tokenizer = self.get_tokenizer()
            if chat_template is not None:
                tokenizer = copy.copy(tokenizer)
                tokenizer.chat_template = chat_template
            self._chats[chat_template] = PromptTokenizer(tokenizer)
        return self._chats[chat_template]
