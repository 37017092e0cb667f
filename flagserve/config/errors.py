"""The one error type of config validation: which key, what is wrong, how to fix it."""
from dataclasses import dataclass


@dataclass
class ConfigError(Exception):
    key: str  # dotted path as typed on the command line, e.g. serve.llm.engine_args.max_num_seqs
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"config error at `{self.key}`: {self.message}"
        return f"{text}\n  fix: {self.fix}" if self.fix else text
