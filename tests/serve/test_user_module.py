"""A user module deployment's calls, without Ray: a sync module runs off the event loop, and
its failures name it."""
import asyncio
import time

import pytest

from flagserve.serve.user_module import UserModuleDeployment

MODULE = '''
import time

class Slow:
    def __call__(self, body):
        time.sleep(0.3)  # a blocking call: a retrieval, a remote check
        return {**body, "seen": True}

class Broken:
    async def __call__(self, body):
        return body["missing"]

class Refusing:
    def __call__(self, body):
        raise ValueError("not allowed")
'''


@pytest.fixture
def deployment(tmp_path):
    path = tmp_path / "mods.py"
    path.write_text(MODULE)
    return lambda name: UserModuleDeployment(name.lower(), str(path), name, {})


def test_a_sync_module_does_not_stall_the_event_loop(deployment):
    slow = deployment("Slow")
    ticks = 0

    async def other_requests():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def main():
        task = asyncio.create_task(other_requests())
        start = time.monotonic()
        out = await slow({"prompt": "x"})
        task.cancel()
        return out, time.monotonic() - start

    out, seconds = asyncio.run(main())
    assert out == {"prompt": "x", "seen": True}
    assert ticks >= 0.5 * seconds / 0.01  # the loop kept turning while the module slept


def test_failures_name_the_module(deployment):
    with pytest.raises(RuntimeError, match="user module 'broken' failed: KeyError: 'missing'"):
        asyncio.run(deployment("Broken")({"prompt": "x"}))
    with pytest.raises(ValueError, match="not allowed"):  # a refusal stays a 400
        asyncio.run(deployment("Refusing")({"prompt": "x"}))


def test_a_modules_body_is_checked_as_the_modules_not_the_clients():
    from flagserve.entrypoints.openai.errors import OpenAIError
    from flagserve.entrypoints.openai.ingress import ModelRoute, OpenAIIngress
    from flagserve.entrypoints.openai.protocol import CompletionRequest
    route = ModelRoute("llm", ["tiny"], None, "/m", None, [("tagger", None)])
    reparse = OpenAIIngress._reparse  # noqa: SLF001 - the check alone, without a server
    assert reparse(CompletionRequest, {"model": "llm", "prompt": "x"}, route).prompt == "x"
    with pytest.raises(OpenAIError) as err:
        reparse(CompletionRequest, {"model": "other", "prompt": "x"}, route)
    assert err.value.status == 500 and "user module(s) tagger set model to 'other'" in str(err.value)
    with pytest.raises(OpenAIError) as err:
        reparse(CompletionRequest, {"prompt": 123}, route)
    assert err.value.status == 500 and "tagger returned a body that is not a valid request" in \
        err.value.message
