"""Where a learning draft head keeps what it learned (``--learn-draft-head``): one folder a deployment under the depctl
home (``HOME/learning/ID``), owner only (mode 0700): the answers it recorded from the deployment's traffic, the head
generations it trained, and the training's state. Deleted with the deployment (``SpecStore.delete``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from depctl import config


def path(deployment_id: str) -> Path:
    return config.home() / "learning" / deployment_id


def delete(deployment_id: str) -> None:
    shutil.rmtree(path(deployment_id), ignore_errors=True)
