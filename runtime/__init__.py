"""depctl's local runtime: the daemon, the speculative engine and the OpenAI-compatible API.

The source folder is ``runtime/``; it installs as ``depctl_runtime``, so that no other package named ``runtime`` can
shadow it or be shadowed by it.
"""

if __name__ != "depctl_runtime":  # imported by its folder name from the repository root: two copies would diverge
    raise ImportError(f"import depctl's runtime as depctl_runtime, not {__name__} (pip install -e . maps the folder)")
