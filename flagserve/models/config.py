"""The fields of a model that the decoder needs, read and checked in one place: from an HF
directory's config.json here, from a GGUF file's metadata in gguf.py."""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from flagserve.layers.rope import RopeConfig, RopeType
from flagserve.models.architectures import HF_ARCHITECTURES

# hf: a directory with config.json, *.safetensors and the tokenizer; gguf: one .gguf file.
ModelFormat = Literal["hf", "gguf"]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2; optional for Llama and Qwen3)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_format: ModelFormat = "hf"
    o_proj_bias: bool = False  # Llama's and Qwen3's attention_bias puts one on o_proj too
    window_capped: bool = False  # max_position_embeddings is the sliding window (Mistral)
    # generation_config.json's sampling fields (SamplingParams names): what vLLM's
    # generation_config "auto" makes the defaults of requests that leave them unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def sampling_defaults_for(self, generation_config: str) -> dict[str, Any]:
        """EngineArgs.generation_config "auto": the model's; "vllm": none (SamplingParams')."""
        return dict(self.sampling_defaults) if generation_config == "auto" else {}

    @property
    def positions_text(self) -> str:
        """The context limit in words, for errors about max_model_len."""
        why = (" (its sliding window: attention over whole contexts is exact only within it)"
               if self.window_capped else "")
        return f"{self.max_position_embeddings} positions{why}"


def model_format(path: str | Path) -> ModelFormat:
    """The one place that tells the formats apart: config, weights and tokenizer all ask here."""
    return "gguf" if str(path).lower().endswith(".gguf") else "hf"


def transformers_location(path: str | Path) -> tuple[str, dict[str, str]]:
    """How transformers' from_pretrained takes `path`: (directory, {}), or for a GGUF file
    (its directory, {"gguf_file": its name})."""
    if model_format(path) == "hf":
        return str(path), {}
    file = Path(path).resolve()
    return str(file.parent), {"gguf_file": file.name}


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # per value, by the names configs use


def auto_dtype(cfg: ModelConfig, on_gpu: bool) -> str:
    """What `dtype: auto` means. On a GPU, an HF checkpoint's own torch_dtype; a GGUF file
    has none worth keeping (it is dequantized anyway): bfloat16. On CPU float32, whatever the
    checkpoint: bfloat16 there is not within tolerance (SmolLM2: logprobs off by up to 0.12 and
    greedy tokens diverging from the first few, against 6e-6 and none in float32), and a bf16
    checkpoint's weights stay bf16 in memory all the same (layers/cpu_matmul.py), which made
    float32 faster than bfloat16 on a CPU without AMX (with AMX, bfloat16 ran SmolLM2 2.1x
    faster: `dtype: bfloat16` asks for it; docs/performance.md, CPU)."""
    if not on_gpu:
        return "float32"
    if cfg.checkpoint_format == "gguf":
        return "bfloat16"
    return cfg.torch_dtype if cfg.torch_dtype in DTYPE_BYTES else "float32"


def _rope_config(cfg: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs use rope_theta +
    # rope_scaling. Real checkpoints on disk use either.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in get_args(RopeType):
        raise ValueError(f"config.json rope type {rope_type!r} is not supported; "
                         f"supported: {get_args(RopeType)}")
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in params}
    return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)


# generation_config.json's sampling defaults, as vLLM reads them (its generation_config "auto")
SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                         "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def _generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _sampling_defaults(generation: dict) -> dict[str, Any]:
    """SamplingParams' fields the model's authors set (HF's max_new_tokens is max_tokens)."""
    return {("max_tokens" if k == "max_new_tokens" else k): generation[k]
            for k in SAMPLING_DEFAULT_KEYS if generation.get(k) is not None}


def _eos_ids(generation: dict, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation, cfg):
        eos = source.get("eos_token_id")
        for token in ([eos] if isinstance(eos, int) else eos or []):
            if token not in ids:
                ids.append(token)
    return tuple(ids)


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
# Architectures whose config's attention_bias adds biases to q/k/v and o_proj (transformers'
# Llama and Qwen3; Qwen2 always has q/k/v biases and none on o_proj, Mistral none at all).
OPTIONAL_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def _checked_architecture(cfg: dict, path: Path) -> str:
    """The config's architecture, once it is one the decoder builds exactly."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"model architecture {archs or cfg.get('model_type')!r} is not supported; "
                         f"supported architectures: {', '.join(HF_ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} in {str(path)!r} is not supported: the MLP's "
                         "kernels are SiLU-gated (silu / swish)")
    missing = [k for k in REQUIRED_FIELDS if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if missing:
        raise ValueError(f"{str(path)!r} lacks {missing[0]!r} (a positive integer), which "
                         "transformers' config of this architecture always has")
    return arch


def load_model_config(model: str | Path) -> ModelConfig:
    """`model`: a local HF model directory or a .gguf file."""
    if model_format(model) == "gguf":
        # Imported here: gguf and numpy cost ~90 ms, and every run.py action (stop and status
        # included) imports this module while few of them read a model.
        from flagserve.models.gguf import gguf_config_fields
        return ModelConfig(**gguf_config_fields(model))
    model_dir = Path(model)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}: "
                                "point `model` at a local HF model directory or a .gguf file")
    cfg = json.loads(path.read_text())
    generation = _generation_config(model_dir)
    arch = _checked_architecture(cfg, path)
    bias = bool(cfg.get("attention_bias", False))
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    sliding = cfg.get("sliding_window")
    use_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    max_pos = cfg.get("max_position_embeddings", 2048)
    capped = bool(sliding and use_sliding and sliding < max_pos)
    if capped:  # without sliding-window attention we stay exact by never exceeding the window
        max_pos = sliding
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        window_capped=capped,
        rope=_rope_config(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Which projections have biases is the architecture's choice, as transformers builds it.
        attention_bias=arch == "Qwen2ForCausalLM" or (arch in OPTIONAL_ATTENTION_BIAS and bias),
        o_proj_bias=arch in OPTIONAL_ATTENTION_BIAS and bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        eos_token_ids=_eos_ids(generation, cfg),
        bos_token_id=cfg.get("bos_token_id"),
        sampling_defaults=_sampling_defaults(generation),
    )
