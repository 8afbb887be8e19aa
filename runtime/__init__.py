"""depctl's local runtime: the daemon, the speculative engine and the OpenAI-compatible API."""
