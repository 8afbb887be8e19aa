"""The cheap seams: what the CLI, the API's request models, the Backend protocol and the daemon's start import.

Loading torch and transformers takes seconds (more on a busy machine); these modules must not pay for it, so that
``depctl --help`` answers at once and the daemon listens before any model is loaded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "llguidance", "numpy")


@pytest.mark.parametrize(
    "module",
    [
        "depctl.cli",
        "depctl.cli.draft",
        "depctl_runtime.backends.base",
        "depctl_runtime.backends",
        "depctl_runtime.api.protocol",
        "depctl_runtime.speculation.params",
        "depctl_runtime.app",
        "depctl_runtime.__main__",
    ],
)
def test_importing_loads_no_engine(module):
    probe = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing {module} loaded {done.stdout.strip()}"


def test_the_speculation_package_still_exports_the_engine():
    from depctl_runtime import speculation

    assert speculation.SpeculativeEngine.__module__ == "depctl_runtime.speculation.engine"
    assert speculation.GenerationParams.__module__ == "depctl_runtime.speculation.params"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        speculation.Nope  # noqa: B018
