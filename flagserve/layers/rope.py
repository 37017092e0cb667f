"""The rotary embedding's parameters, as config.json gives them. No torch here: the config
checks of run.py (stop and status included) read model configs without loading torch."""
from dataclasses import dataclass
from typing import Literal

RopeType = Literal["default", "linear", "llama3"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # GGUF's rope_freqs tensor: each frequency divided by its factor, after the rules above
    # (how llama.cpp applies Llama-3 scaling: convert_hf_to_gguf precomputes the factors).
    freq_factors: tuple[float, ...] | None = None
