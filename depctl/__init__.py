"""depctl: local speculative-decoding deployments (CLI, spec store, client)."""

from importlib import metadata

try:
    __version__ = metadata.version("depctl")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
