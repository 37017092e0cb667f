"""The one error type of config validation: which key, what is wrong, how to fix it."""
import re
from dataclasses import dataclass, replace
from typing import Any


@dataclass
class ConfigError(Exception):
    key: str  # dotted path as typed on the command line, e.g. serve.llm.engine_args.max_num_seqs
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"config error at `{self.key}`: {self.message}"
        return f"{text}\n  fix: {self.fix}" if self.fix else text

    def as_typed(self, serve: Any) -> "ConfigError":
        """Keys as the command line reaches them: a config in FlagScale's list form (`serve`
        a list of entries with `serve_id`) overrides `serve.<index>`, not `serve.<serve_id>`."""
        if not isinstance(serve, (list, tuple)) and type(serve).__name__ != "ListConfig":
            return self
        index = {str(e.get("serve_id")): i for i, e in enumerate(serve) if hasattr(e, "get")}
        pattern = re.compile(r"\bserve\.([A-Za-z0-9_-]+)(?=[.`\s=]|$)")

        def typed(text: str) -> str:
            return pattern.sub(lambda m: f"serve.{index.get(m.group(1), m.group(1))}", text)
        return replace(self, key=typed(self.key), message=typed(self.message), fix=typed(self.fix))
