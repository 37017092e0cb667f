"""User modules: a class from a .py file, deployed as its own Ray Serve deployment.

The class is called with the OpenAI request body (a dict) and returns the body to pass on,
so a module can rewrite prompts, add retrieved context, or filter requests:

    class Retriever:
        def __init__(self, top_k: int = 2): ...          # init_args from the config
        async def __call__(self, body: dict) -> dict: ...  # sync ones run on a thread

Raising ValueError rejects the request with HTTP 400 and the error's message; any other
exception is an HTTP 500 naming the module.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any


def load_class(path: str, name: str) -> type:
    module_name = f"flagserve_user_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


class UserModuleDeployment:
    def __init__(self, module_id: str, path: str, class_name: str, init_args: dict[str, Any]):
        self.module_id = module_id
        self.instance = load_class(path, class_name)(**init_args)

    async def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            result = await self._call(body)
        except ValueError:
            raise  # the module refuses the request: HTTP 400 with its message
        except Exception as err:
            raise RuntimeError(f"user module {self.module_id!r} failed: "
                               f"{type(err).__name__}: {err}") from err
        if not isinstance(result, dict):
            raise TypeError(f"user module {self.module_id!r} returned {type(result).__name__}, "
                            "expected the request body (dict)")
        return result

    async def _call(self, body: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.instance.__call__):
            return await self.instance(body)
        # On a thread: a sync module that blocks (a retrieval call, a sleep) would otherwise
        # stall every request this replica holds, the event loop being theirs too.
        result = await asyncio.to_thread(self.instance, body)
        return await result if inspect.isawaitable(result) else result
