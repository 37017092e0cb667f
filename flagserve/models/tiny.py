"""Deterministic tiny random-weight models in Hugging Face format: the project's built-in model.

There is no network on the machines this project is developed on, so every test, benchmark
and the default experiment serve a model generated here. The output is an ordinary HF
directory (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) that transformers loads with AutoModelForCausalLM / AutoTokenizer,
which makes HF transformers the reference for exact greedy outputs.

    python -m flagserve.models.tiny OUT_DIR [--arch llama|mistral|qwen2|qwen3] [--seed N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported lazily: it costs seconds
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

from flagserve.models.architectures import ARCHS, Arch
from flagserve.models.cache import default_model_dir
from flagserve.models.tiny_corpus import CORPUS

_QWEN = ("qwen2", "qwen3")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# The BPE trainer gives special tokens the first ids in this order, so the ids are fixed
# no matter what the corpus or vocabulary size is.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))
VOCAB_SIZE = 1536  # a multiple of 64: 256 bytes + 5 specials + merges

# Qwen2's pre-tokenizer split pattern (the one transformers' Qwen2Tokenizer hard-codes).
_QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. Llama-style tokenizers start the prompt with BOS inside the template (as Llama 3
# does), because apply_chat_template(tokenize=True) encodes without special tokens.
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TEMPLATES = {
    "llama": "{{- bos_token }}" + _CHATML,
    "mistral": "{{- bos_token }}" + _CHATML,
    "qwen2": _CHATML,
    "qwen3": _CHATML,
}

# Shared shape: big enough to exercise GQA, multi-layer and multi-head code paths, small
# enough that a CPU forward pass takes milliseconds.
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    hidden_act="silu",
)
# Per-architecture differences, each one a code path the engine must get right.
_ARCH: dict[str, dict[str, Any]] = {
    "llama": dict(
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        # Llama 3.1 style frequency-dependent scaling; original length 256 < 2048 so the
        # scaling actually changes the frequencies used in tests.
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "mistral": dict(
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None
    ),
    "qwen2": dict(  # q/k/v biases come with the architecture
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False
    ),
    "qwen3": dict(  # head_dim != hidden_size / num_heads, q/k RMSNorm
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        head_dim=32,
        use_sliding_window=False,
    ),
}


def build_tokenizer(arch: Arch = "llama", model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on the embedded corpus (deterministic, ~50 ms)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _check_arch(arch)
    tok = Tokenizer(models.BPE())
    if arch in _QWEN:
        # transformers 5.x loads a model_type "qwen2" directory with its Qwen2Tokenizer, which
        # rebuilds the pipeline from vocab + merges with Qwen's split regex and NFC. Using that
        # exact pipeline here keeps tokenizer.json and AutoTokenizer in agreement.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # Byte-level: every string, including emoji and any script, encodes without <unk>.
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        # Llama prepends BOS, Qwen adds nothing. This only shapes the post-processor written
        # into tokenizer.json, which is what decides from then on: transformers 5.x neither
        # saves nor reads add_bos_token (a loaded tokenizer reports add_bos_token=False).
        add_bos_token=arch not in _QWEN,
        add_eos_token=False,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATES[arch],
        # Decoding must give back exactly the text that was encoded.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def build_config(arch: Arch = "llama", **overrides: Any) -> PretrainedConfig:
    """The transformers config for `arch`; `overrides` replace any config field."""
    from transformers import AutoConfig

    _check_arch(arch)
    if overrides.get("vocab_size", VOCAB_SIZE) < VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= the tokenizer's {VOCAB_SIZE} tokens")
    fields: dict[str, Any] = {
        **_COMMON,
        **_ARCH[arch],
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        **overrides,
    }
    # rope_theta / rope_scaling are the 4.x spelling; 5.x converts them to rope_parameters.
    return AutoConfig.for_model(arch, **fields)


# Init scales, tuned by measuring greedy generations (see init_weights_).
# Small embeddings keep the residual stream from being dominated by the current token: with
# a tied LM head that makes the model echo its input, untied it acts like a bigram table.
_EMBED_STD = 0.05
# Linear layers slightly expanding (std gain/sqrt(fan_in)): with gain 1 greedy generations
# fall into one-token loops within a few steps; 1.5 keeps them varied, activations stay < ~15.
_LINEAR_GAIN = 1.5
_LOGIT_STD = 4.0  # spread of the logits: median top1-top2 margin ~0.8, far from fp16 limits


@torch.no_grad()
def init_weights_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a seeded generator, scaled so the model is decisive.

    HF's default init (std 0.02) gives nearly uniform logits, where greedy argmax near-ties
    make token-exact comparisons between two implementations flaky. Here activations stay
    O(1..10) and the LM head spreads logits by about _LOGIT_STD.
    """
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    hidden = config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # logits = norm(h) . W_head, with norm(h) O(1) per element: W_head std s gives logit std
    # s * sqrt(hidden). A tied head is the embedding, so the final norm gain makes up the rest.
    head_std = _LOGIT_STD / hidden**0.5
    final_norm_gain = head_std / _EMBED_STD if tied else 1.0
    # named_parameters() lists a tied lm_head once (as embed_tokens), in module order.
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name == "model.norm.weight":
            value = final_norm_gain * (1.0 + 0.1 * noise)
        elif "norm" in name:  # RMSNorm gains: 1 with a little noise so they are not no-ops
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.1 * noise
        elif "embed_tokens" in name:
            value = _EMBED_STD * noise
        elif "lm_head" in name:
            value = head_std * noise
        else:  # Linear weight [out, in]
            value = noise * (_LINEAR_GAIN / p.shape[1] ** 0.5)
        p.copy_(value.to(p.dtype))


def make_tiny_model(
    out_dir: str | Path, arch: Arch = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Write the tiny `arch` model with weights from `seed` into `out_dir`; returns its path.

    `overrides` replace config fields (num_hidden_layers, hidden_size, tie_word_embeddings,
    max_position_embeddings, ...). The same arguments always give byte-identical files.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights_(model, seed)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        # A chat turn ends with <|im_end|>; plain completions end with <|end_of_text|>.
        eos_token_id=[EOS_ID, IM_END_ID],
        pad_token_id=PAD_ID,
        do_sample=False,
    )
    with _quiet_transformers():
        model.save_pretrained(out)
        # The chat template goes into tokenizer_config.json, where every reader looks for it.
        tokenizer = build_tokenizer(arch, model_max_length=config.max_position_embeddings)
        tokenizer.save_pretrained(out, save_jinja_files=False)
    _add_legacy_rope_keys(out / "config.json")
    _make_tokenizer_config_portable(out / "tokenizer_config.json")
    for f in out.iterdir():  # safetensors is written 0600; the cache may be shared
        f.chmod(0o644)
    return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence the "Writing model shards" progress bar for the duration of a save."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _add_legacy_rope_keys(path: Path) -> None:
    """Also write rope_theta / rope_scaling, so transformers 4.x and other readers of the old
    form see the same RoPE; 5.x reads them back into identical rope_parameters."""
    data = json.loads(path.read_text())
    rope = dict(data.get("rope_parameters") or {})
    if "rope_theta" in rope:
        data["rope_theta"] = rope.pop("rope_theta")
        data["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    _write_json(path, data)


def _make_tokenizer_config_portable(path: Path) -> None:
    """transformers 5.x writes a tokenizer_config.json that 4.x cannot load ("TokenizersBackend",
    a list-valued extra_special_tokens); write the spelling both versions read the same way."""
    data = json.loads(path.read_text())
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in data:
        data["additional_special_tokens"] = data.pop("extra_special_tokens")
    # Explicitly none: otherwise 5.x's Qwen2Tokenizer adds its default "<|endoftext|>" unk
    # token, one id past the model's vocabulary.
    data["unk_token"] = None
    _write_json(path, data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def ensure_tiny_model(path: str | Path | None = None, arch: Arch = "llama") -> Path:
    """Return `path` (default: default_model_dir(arch)), generating the model if it is missing.

    Builds in a temporary sibling directory and renames it into place, so concurrent processes
    (parallel tests, Ray workers) never see a half-written model: the rename either publishes
    a complete directory or loses to one that another process published first.
    """
    target = Path(path) if path is not None else default_model_dir(arch)
    if target.exists():
        missing = [f for f in _REQUIRED_FILES if not (target / f).exists()]
        if missing:
            raise FileExistsError(f"{target} exists but lacks {missing}; delete it to regenerate")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_tiny_model(tmp, arch=arch)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {', '.join(ARCHS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flagserve.models.tiny", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config field; VALUE is JSON (e.g. --set num_hidden_layers=4)",
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    print(make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, **overrides))


if __name__ == "__main__":
    main()
