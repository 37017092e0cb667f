"""The environment of the serving process: ours + `envs` + what `cmds.before_start` exports."""
from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from flagserve.cluster.ray_env import SERVE_ENV, token_auth_env
from flagserve.config.errors import ConfigError
from flagserve.config.schema import Config

REPO_ROOT = Path(__file__).resolve().parents[2]


def hook_env(config: Config) -> dict[str, str]:
    """This environment plus `experiment.envs`: where after_stop runs (before_start's exports
    are the server's; running before_start again to get them would repeat its side effects)."""
    return {**os.environ, **config.experiment.exported_envs()}


def server_env(config: Config, token_file: Path | None = None) -> dict[str, str]:
    env = dict(SERVE_ENV)  # Ray Serve's latency settings; the caller's environment wins
    env.update(hook_env(config))
    if config.experiment.cmds.before_start:
        env = _env_after(config.experiment.cmds.before_start, env, "experiment.cmds.before_start")
    # Ray workers import flagserve even when it is not pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if token_file is not None:
        env.update(ray_auth_env(token_file))
    return env


def ray_auth_env(token_file: Path) -> dict[str, str]:
    """token_auth_env with this experiment's token file, created on first use."""
    if not token_file.exists():
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return token_auth_env(str(token_file))


def run_hook(command: str | None, env: dict[str, str], key: str) -> None:
    if command:
        result = subprocess.run(["bash", "-c", command], env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{key} exited with {result.returncode}: {command}")


def _env_after(command: str, env: dict[str, str], key: str) -> dict[str, str]:
    """Run `command` in bash and return the environment it leaves (so `export`/`source` work).

    The environment is dumped to a file, not stdout, so the command may print freely."""
    with tempfile.NamedTemporaryFile(prefix="flagserve-env-") as dump:
        script = (f"{command}\n__rc=$?\n[ \"$__rc\" -eq 0 ] || exit \"$__rc\"\n"
                  f"exec {shlex.join([sys.executable, '-c', _DUMP_ENV, dump.name])}")
        result = subprocess.run(["bash", "-c", script], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        if result.returncode != 0:
            raise ConfigError(key, f"exited with {result.returncode}: "
                              f"{result.stderr.decode(errors='replace').strip()[-500:]}",
                              "make the command succeed on its own: bash -c '<command>'")
        items = Path(dump.name).read_bytes().split(b"\0")
    pairs = (item.decode(errors="replace").partition("=") for item in items)
    return {k: v for k, sep, v in pairs if sep}


_DUMP_ENV = ("import os, sys; open(sys.argv[1], 'wb').write("
             "b'\\0'.join(f'{k}={v}'.encode() for k, v in os.environ.items()))")
