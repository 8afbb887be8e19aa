"""depctl chat's own files: the history of what a user typed is theirs alone, as prompt recordings are."""

from __future__ import annotations

import stat

from depctl.cli.chat import history_file


def test_the_history_file_is_readable_by_its_owner_only(depctl_home):
    path = history_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)  # one an older depctl left readable by everyone
    path.write_text("a secret prompt\n")
    assert history_file() == path and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "a secret prompt\n"  # kept
