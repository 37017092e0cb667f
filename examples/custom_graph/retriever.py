"""A user module for FlagServe's serving graph: adds matching facts to the request.

Deployed by examples/custom_graph/conf (serve.retriever) in front of the LLM
(serve.llm.depends: [retriever]): every request for the model passes through __call__
first. A real retriever would query a vector store here.
"""
from __future__ import annotations

from typing import Any

DEFAULT_FACTS = {
    "flagserve": "FlagServe serves LLMs with its own paged-attention engine on Ray Serve.",
    "paris": "Paris is the capital of France.",
}


class Retriever:
    def __init__(self, facts: dict[str, str] | None = None, top_k: int = 2):
        self.facts = {k.lower(): v for k, v in (facts or DEFAULT_FACTS).items()}
        self.top_k = top_k

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        query = _query(body).lower()
        hits = [fact for key, fact in self.facts.items() if key in query][: self.top_k]
        if not hits:
            return body
        context = "Context:\n" + "\n".join(hits)
        if "messages" in body:
            return {**body, "messages": [{"role": "system", "content": context}, *body["messages"]]}
        if isinstance(body.get("prompt"), str):
            return {**body, "prompt": f"{context}\n\n{body['prompt']}"}
        return body


def _query(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content)
            return content or ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""
