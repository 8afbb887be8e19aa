"""The daemon's entry point: the port it binds is its own from the moment it is bound."""

from __future__ import annotations

import pytest

from depctl_runtime.__main__ import bind


def test_a_second_daemon_cannot_bind_the_port_of_one_still_starting():
    # the bug: bound with SO_REUSEADDR and listening only once the app had loaded, seconds later: a second daemon
    # (another home) bound the same port in that window, and both logged "listening"
    first = bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError):
            bind("127.0.0.1", port).close()
    finally:
        first.close()
    bind("127.0.0.1", port).close()  # and once it is gone, the port is free again at once
