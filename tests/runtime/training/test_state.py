"""Training state round-trips through safetensors and JSON, and nothing in a ``.train`` folder is ever unpickled."""

from __future__ import annotations

import pickle

import torch

from depctl_runtime.training.state import load_rows, load_state, save_rows, save_state
from tests.pickles import plant


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_a_state_round_trips_and_training_goes_on_identically(tmp_path):
    model, optimizer = _trained()
    info = {"trained_seconds": 1.5, "history": [{"loss": 0.5}], "config": {"a": [1, 2]}}
    save_state(tmp_path, model.state_dict(), optimizer.state_dict(), info)
    head, opt_state, back = load_state(tmp_path, "cpu")
    assert back == info
    twin, _ = _trained()  # the same architecture, then loaded from disk
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin.load_state_dict(head)
    twin_opt.load_state_dict(opt_state)
    x = torch.randn(5, 8)
    for m, o in ((model, optimizer), (twin, twin_opt)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_answer_rows_round_trip(tmp_path):
    rows = [
        {"index": i, "sample": s, "start": 3, "tokens": torch.arange(6) + i, "features": torch.randn(5, 12)}
        for i in range(3)
        for s in range(2)
    ]
    save_rows(rows, tmp_path / "answers-0.safetensors")
    back = load_rows(tmp_path / "answers-0.safetensors")
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
        )


def test_no_file_in_a_train_folder_is_unpickled(tmp_path):
    # the bug: resuming read .train/state.pt with torch.load(weights_only=False); a crafted one ran a shell command
    marker = tmp_path / "ran"
    folder = tmp_path / ".train"
    for name in ("state.pt", "answers-0.pt", "state.safetensors", "answers-1.safetensors"):
        plant(folder / name, marker)
    (folder / "state.json").write_text('{"tensors_bytes": %d}' % (folder / "state.safetensors").stat().st_size)
    assert load_state(folder, "cpu") is None  # a state.safetensors that is a pickle: no state, nothing run
    try:
        load_rows(folder / "answers-1.safetensors")
    except Exception:  # noqa: BLE001 - refused as a damaged shard is; what matters is that nothing ran
        pass
    assert not marker.exists()
    pickle.loads((folder / "state.pt").read_bytes())  # the payload is live: loading it the old way runs it
    assert marker.exists()
