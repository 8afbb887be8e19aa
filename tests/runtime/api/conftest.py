"""The API's fixtures: a daemon's app in process over tiny deployments (``sdks.run`` drives it)."""

from __future__ import annotations

import os
import time

import pytest

from depctl.settings import Settings
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation, SuffixSpeculation
from depctl.store import SpecStore
from depctl_runtime.app import create_app
from depctl_runtime.backends.loader import load_deployment
from depctl_runtime.manager import DeploymentManager, State
from tests.tiny import TOOLS_TEMPLATE, save_tiny


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir, tiny_draft_dir):
    """Tiny deployments under every speculation method (``sdks.METHODS``) and one whose template takes tools."""
    home = tmp_path_factory.mktemp("sdk-home")
    old = os.environ.get("DEPCTL_HOME")
    os.environ["DEPCTL_HOME"] = str(home)
    store = SpecStore(home / "deployments")
    model = str(tiny_model_dir)
    with_tools = str(save_tiny(tmp_path_factory.mktemp("with-tools"), seed=0, chat_template=TOOLS_TEMPLATE))
    specs = [
        DeploymentSpec(id="plain", model=model, compile=False),
        DeploymentSpec(
            id="ngram", model=model, compile=False, speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4)
        ),
        DeploymentSpec(id="suffix", model=model, compile=False, speculation=SuffixSpeculation(num_draft_tokens=6)),
        DeploymentSpec(
            id="drafted",
            model=model,
            compile=False,
            speculation=DraftModelSpeculation(draft_model=str(tiny_draft_dir), num_draft_tokens=3),
        ),
        DeploymentSpec(id="tools", model=with_tools, compile=False),
    ]
    for spec in specs:
        store.create(spec)
    manager = DeploymentManager(
        store, loader=lambda spec, report: load_deployment(spec, calibrate=False, report=report)
    )
    manager.start()
    deadline = time.monotonic() + 300
    while any(manager.get(s.id).state != State.READY for s in specs):
        assert time.monotonic() < deadline, [(s.id, manager.get(s.id).state) for s in specs]
        time.sleep(0.1)
    yield create_app(manager=manager, settings=Settings())
    manager.stop()
    if old is None:
        os.environ.pop("DEPCTL_HOME", None)
    else:
        os.environ["DEPCTL_HOME"] = old
