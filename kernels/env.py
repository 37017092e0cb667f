"""Settings read from the environment, each checked against its mode's choices."""
import os
from collections.abc import Mapping
from typing import Any, Literal, get_args

Switch = Literal["on", "off"]  # a setting that is on or off


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def env_choice(name: str, mode: Any, default: str, requested: str | None = None,
               environ: Mapping[str, str] | None = None) -> Any:
    """`requested`, else the environment's `name`, else `default`: one of the `Literal` mode's
    values, or a ValueError naming the variable and its choices."""
    value = requested
    if value is None:
        value = (os.environ if environ is None else environ).get(name, default)
    if value not in get_args(mode):
        raise ValueError(f"{name} must be one of {get_args(mode)}, got {value!r}")
    return value
