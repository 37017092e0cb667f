"""User modules: a class from a .py file, deployed as its own Ray Serve deployment.

The class is called with the OpenAI request body (a dict) and returns the body to pass on,
so a module can rewrite prompts, add retrieved context, or filter requests:

    class Retriever:
        def __init__(self, top_k: int = 2): ...          # init_args from the config
        async def __call__(self, body: dict) -> dict: ...  # sync methods work too

Raising ValueError rejects the request with HTTP 400 and the error's message.
"""
from __future__ import annotations

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
        result = self.instance(body)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, dict):
            raise TypeError(f"user module {self.module_id!r} returned {type(result).__name__}, "
                            "expected the request body (dict)")
        return result
