"""`braid serve`: the OpenAI-compatible HTTP server."""
