"""Command-line overrides Hydra cannot apply, as the project's one ConfigError.

Hydra composes the YAML before FlagServe sees it; a key missing from the file (a typo, or a
schema key the file does not list) stops it with its own multi-line error. run.py hands
that exception here: the key, the keys the schema knows there (with a did-you-mean), and
exit code 2 like every config error.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

from flagserve.config.errors import ConfigError
from flagserve.config.load import ENGINE_ARG_NAMES
from flagserve.config.schema import Config
from flagserve.config.typed import unknown_key_error


def known_keys(path: list[str]) -> list[str] | None:
    """The keys the schema allows under dotted `path` ([] = the top); None when it does not
    say (a free-form mapping such as envs, or hydra.*)."""
    if path[-1:] == ["engine_args"]:
        return sorted(ENGINE_ARG_NAMES)
    kinds: list[Any] = [Config]
    for part in path:
        kinds = [_child(k, part) for k in _alternatives(kinds)]
        kinds = [k for k in kinds if k is not None]
    keys = {f.name for k in _alternatives(kinds) if dataclasses.is_dataclass(k)
            for f in dataclasses.fields(k) if f.init}
    return sorted(keys) or None


def _alternatives(kinds: list[Any]) -> list[Any]:
    """Unions (Optional, LLMModule | UserModule) as their members."""
    out = []
    for kind in kinds:
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            out += [a for a in typing.get_args(kind) if a is not type(None)]
        else:
            out.append(kind)
    return out


def _child(kind: Any, key: str) -> Any:
    if dataclasses.is_dataclass(kind):
        return typing.get_type_hints(kind).get(key)
    if typing.get_origin(kind) is dict:
        return typing.get_args(kind)[1]
    return None


def override_error(err: Exception, overrides: list[str] = ()) -> ConfigError:
    """Hydra's composition error -> a ConfigError naming the key and the fix; `overrides`:
    the command line's, to name the one at fault where Hydra's message does not."""
    text = str(err).strip()
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key and "not in struct" in str(cause):
        # OmegaConf writes list items as serve[0]: the command line reaches them as serve.0
        full_key = re.sub(r"\[(\d+)\]", r".\1", str(full_key))
        *parent, key = full_key.split(".")
        known = known_keys(parent)
        if known is None or key in known:  # a schema key, or one of a free-form mapping (envs)
            # the override as typed where it reaches below the missing key (a section's field)
            typed = next((k for o in overrides if (k := o.lstrip("+~").partition("=")[0])
                          .startswith(f"{full_key}.")), full_key)
            return ConfigError(full_key, "is not listed in this config file",
                               f"add it with +{typed}=<value>")
        return unknown_key_error(".".join(parent), key, known)
    first, _, rest = text.partition("\n")
    if type(err).__name__ == "MissingConfigException":  # a config group option, or the file
        group = re.match(r"In '([^']+)': (.*)", first)
        options = re.findall(r"^\t(\S+)$", rest.split("Config search path")[0], re.M)
        return ConfigError(group.group(1) if group else "--config-name",
                           group.group(2) if group else first,
                           f"use one of: {', '.join(options)}" if options
                           else "check --config-path and --config-name")
    if "LexerNoViableAltException" in first or "mismatched input" in first:
        # Hydra's grammar: a value with spaces or shell characters needs quotes, and one
        # argument holds one override
        override = first.split(": ", 1)[-1] if "Lexer" in first else "command line"
        return ConfigError(override.partition("=")[0] or "command line", f"cannot be parsed: {first}",
                           "one override per argument, a value with spaces or shell characters "
                           "in quotes: \"key='echo a; exit 3'\"")
    index = re.match(r"Index '([^']+)' \(str\) is not an int", first)
    if index:  # a name where the file has a list: FlagScale's list form of `serve`
        return _list_index_error(index.group(1), overrides)
    quoted = re.search(r"'([^']+)'", text)
    return ConfigError(quoted.group(1) if quoted else "command line", first,
                       rest.strip().replace("\n", "; ") or "see README.md, Config reference")


def _list_index_error(name: str, overrides: list[str]) -> ConfigError:
    """An override that names a list item by name (serve.qwen.x where the file lists serve
    as FlagScale's `- serve_id: qwen` entries): lists are indexed by position in the file."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        parts = key.split(".")
        if name in parts[1:]:
            at = parts.index(name)
            listed = ".".join(parts[:at])
            fixed = ".".join([*parts[:at], "0", *parts[at + 1:]])
            return ConfigError(key, f"`{listed}` is a list in this config file (FlagScale's list "
                               f"form), indexed by position, not by {name!r}",
                               f"use the entry's position, e.g. {fixed}=... for the first")
    return ConfigError(name, f"{name!r} names an item of a list (indexed by position)",
                       "use the entry's position, e.g. serve.0.<key>=...")
