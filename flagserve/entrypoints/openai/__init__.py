"""The OpenAI-compatible HTTP layer: routes, request models, response formatting, SSE streams,
the replica's own HTTP server, and the chat template and tokenization done in the ingress.
It knows no Ray: the serving graph (flagserve/serve) hands it its engines as EngineClients."""
