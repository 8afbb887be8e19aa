"""depctl: local speculative-decoding deployments (CLI, spec store, client)."""

__version__ = "0.1.0"
