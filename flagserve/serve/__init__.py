"""The Ray Serve graph behind the OpenAI-compatible API (see app.py for the wiring)."""
