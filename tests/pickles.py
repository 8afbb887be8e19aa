"""A pickle that runs code when it is loaded: planted in the files depctl reads, to prove it never unpickles them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> Path:
    """Write a pickle at ``path`` whose loading creates ``marker``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"head": _Payload(marker)}))
    return path
