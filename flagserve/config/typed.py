"""Build dataclasses from plain dicts, checking unknown keys, types and `Literal` modes
with the key path.

OmegaConf's structured configs raise tracebacks with internal names; this gives one
ConfigError naming the dotted key, what was expected and a close match for typos.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

from flagserve.config.errors import ConfigError

T = TypeVar("T")


def join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def unknown_key_error(path: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return ConfigError(join(path, key), "unknown key",
                       f"{hint}remove it or use one of: {', '.join(sorted(known))}")


def build(cls: type[T], data: Any, path: str) -> T:
    """Instantiate dataclass `cls` from mapping `data`; `path` is where it sits in the config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be a mapping, got {type(data).__name__} {data!r}",
                          f"write `{path}` as a YAML mapping of keys to values")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise unknown_key_error(path, str(key), list(fields))
    values = {name: coerce(hints[name], data[name], join(path, name))
              for name in fields if name in data}
    return cls(**values)


def _choices(tp: Any) -> tuple | None:
    """The values a Literal, or a Literal | None, admits; None for any other type."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if all(a is type(None) or typing.get_origin(a) is typing.Literal for a in args):
            return tuple(v for a in args
                         for v in ((None,) if a is type(None) else typing.get_args(a)))
    return None


def _choice(value: Any, allowed: tuple, path: str, in_list: bool = False) -> Any:
    if value in allowed:
        return value
    shown = ", ".join("null" if v is None else str(v) for v in allowed)
    if in_list:
        fix = f"use a list of: {shown} (or [] for none)"
    else:
        fix = f"set {path}={shown}" if len(allowed) == 1 else f"use one of: {shown}"
    raise ConfigError(path, f"unknown value {value!r}", fix)


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against type hint `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if (allowed := _choices(tp)) is not None:
        return _choice(value, allowed, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None  # not a default-built section: `disaggregation: null` means none
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:
            return build(sections[0], value, path)  # its own error names the key inside
        for arg in typing.get_args(tp):
            try:
                return coerce(arg, value, path)
            except ConfigError:
                pass
        raise ConfigError(path, f"must be {_describe(tp)}, got {value!r}",
                          f"set {path}=<{_describe(tp)}>")
    if tp is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)
            if (allowed := _choices(item)) is not None:
                # A list of modes is typed whole (`key=[a,b]`): name the list, not an index.
                return [_choice(v, allowed, path, in_list=True) for v in value]
            return [coerce(item, v, join(path, i)) for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, item = typing.get_args(tp)
            return {str(k): coerce(item, v, join(path, k)) for k, v in value.items()}
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {tp!r} at {path}")
    raise ConfigError(path, f"must be {_describe(tp)}, got {type(value).__name__} {value!r}",
                      f"set {path} to {_describe(tp)}")
