"""Python child processes of the engine (`python -m <module> FD...`): their environment."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding flagserve/


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) with flagserve importable, wherever the parent was started."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env
