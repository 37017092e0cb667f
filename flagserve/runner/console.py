"""What the runner tells its user, whichever Deployment it drives: the ready message, the
command lines to copy, the end of a log."""
from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

from flagserve.config.schema import Config
from flagserve.config.topology import served_names

CONFIG_OPTIONS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")
LOCATING_KEYS = ("experiment.exp_name=", "experiment.exp_dir=")


def python_command() -> str:
    """The interpreter as the user can type it: .venv/bin/python, not a bare `python` that an
    unactivated shell may not have (or that lacks our packages)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def same_command(action: str, exp_dir: str | None = None) -> str:
    """This experiment's command line with another action, for copy and paste: the config
    file and where the records are (status and stop need nothing else: locate.py), never
    the other overrides (an API key among them)."""
    args, argv = [], sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg in CONFIG_OPTIONS and i + 1 < len(argv):
            args += [arg, argv[i + 1]]
        elif arg.startswith(tuple(f"{o}=" for o in CONFIG_OPTIONS)):
            args.append(arg)
        elif arg.lstrip("+").startswith(LOCATING_KEYS) and exp_dir is None:
            args.append(arg.lstrip("+"))
    if exp_dir is not None:
        args.append(f"experiment.exp_dir={exp_dir}")
    return shlex.join([python_command(), "run.py", *args, f"action={action}"])


class Progress:
    """What the serving process reports while `run` waits for it: its `flagserve.server`
    INFO lines (starting Ray, deploying, serving), with the seconds since the start."""
    MARK = b" flagserve.server INFO "
    QUIET_S = 10.0  # a line at least this often: a model load is a long silence otherwise

    def __init__(self, log: Path | None):
        self.log, self.start = log, time.monotonic()
        self.offset = log.stat().st_size if log is not None and log.exists() else 0
        self.last = self.start

    def show(self) -> None:
        if self.log is None or not self.log.exists():
            return
        with self.log.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        lines, _, _ = data.rpartition(b"\n")  # complete lines only
        self.offset += len(lines) + (1 if lines else 0)
        texts = [line.split(self.MARK, 1)[1].decode(errors="replace")
                 for line in lines.splitlines() if self.MARK in line]
        if not texts and time.monotonic() - self.last > self.QUIET_S:
            texts = [f"still starting (log {self.log})"]
        for text in texts:
            self.last = time.monotonic()
            print(f"  {self.last - self.start:5.1f} s  {text}", flush=True)


def print_ready(config: Config, url: str, where: str = "", hints: bool = True) -> None:
    """The endpoint; with `hints`, a request to try it and how to check and stop it (the one
    instruction block a user sees); `where`: the hosts."""
    print(f"{config.experiment.exp_name} is serving an OpenAI-compatible API at {url}/v1{where}",
          flush=True)
    if not hints:
        return
    module_id, module = next(iter(config.llms.items()))
    body = json.dumps({"model": served_names(module_id, module)[0],
                       "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    # Double quotes: the shell expands the variable (the key itself is never printed).
    auth = ' -H "Authorization: Bearer $FLAGSERVE_API_KEY"' if config.api_key else ""
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d {shlex.quote(body)}\n"
          f"  status: {same_command('status')}\n"
          f"  stop:   {same_command('stop')}", flush=True)


# An exception's summary line in a traceback ("ValueError: ...", "safetensors.SafetensorError: ..."),
# after Ray's colours and its "(ServeReplica:app:llm pid=N)" prefix of a worker's lines
ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): (?!Traceback \(most)")
RAY_PREFIX = re.compile(r"^\([^)]*pid=\d+[^)]*\)\s*")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tail(log: Path | None, lines: int, since: int = 0) -> str:
    """What a failed start's log says from byte `since` (where this run's output begins: the
    log holds every run's): its first errors, then its last `lines` lines, headed by its path
    ("" when there is none)."""
    if log is None or not log.exists():
        return ""
    with log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace").splitlines()
    first = _first_errors(text)
    return "\n".join([*first, f"last lines of {log}:", *text[-lines:]])


def _first_errors(lines: list[str], most: int = 5) -> list[str]:
    """The first distinct exception lines: where the failure began (the tail holds what
    failed after it: Serve's deploy error, shutdown noise)."""
    found: list[str] = []
    for line in lines:
        line = RAY_PREFIX.sub("", ANSI.sub("", line).strip())
        if ERROR_LINE.match(line) and line[:400] not in found:
            found.append(line[:400])
            if len(found) == most:
                break
    return ["first errors in the log:", *(f"  {e}" for e in found)] if found else []
