"""What the runner tells its user, whichever Deployment it drives: the ready message, the
command lines to copy, the end of a log."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from flagserve.config.schema import Config
from flagserve.config.topology import served_names


def same_command(action: str) -> str:
    """This command line with another action, for copy and paste."""
    args = [a for a in sys.argv[1:] if not a.startswith("action=")]
    return shlex.join(["python", "run.py", *args, f"action={action}"])


def print_ready(config: Config, url: str, where: str = "") -> None:
    """The endpoint, a request to try it, how to check and stop it; `where`: the hosts."""
    module_id, module = next(iter(config.llms.items()))
    body = json.dumps({"model": served_names(module_id, module)[0],
                       "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = " -H 'Authorization: Bearer $FLAGSERVE_API_KEY'" if config.api_key else ""
    print(f"{config.experiment.exp_name} is serving an OpenAI-compatible API at {url}/v1{where}\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d {shlex.quote(body)}\n"
          f"  status: {same_command('status')}\n"
          f"  stop:   {same_command('stop')}", flush=True)


def tail(log: Path | None, lines: int) -> str:
    """The last `lines` lines of a log, headed by its path ("" when there is none)."""
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return f"last lines of {log}:\n" + "\n".join(text)
