"""The spec store: round trip, atomic writes, concurrent writers, broken files beside good ones."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import yaml

from depctl import recordings
from depctl.errors import ConflictError, NotFoundError, SpecError, UsageError
from depctl.spec import DeploymentSpec, DraftModelSpeculation, NgramSpeculation
from depctl.store import SpecStore, parse_spec


def make(dep_id: str = "a", **kw) -> DeploymentSpec:
    return DeploymentSpec(id=dep_id, model="smollm2-135m-instruct", **kw)


def test_round_trip_keeps_only_intent(depctl_home):
    store = SpecStore()
    spec = make(speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4), display_name="chat")
    store.create(spec)
    assert store.get("a") == spec
    raw = yaml.safe_load((store.root / "a.yaml").read_text())
    assert set(raw) == {
        "id",
        "display_name",
        "model",
        "speculation",
        "max_batch_size",
        "device",
        "dtype",
        "quantization",
        "compile",
        "engine",
        "max_context_length",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "ray_address",
        "keep_alive",
        "record_prompts",
        "prefix_cache_bytes",
        "prefix_cache_scope",
        "learn_draft_head",
        "sampling",
        "created_at",
        "updated_at",
    }
    assert "state" not in raw  # status belongs to the daemon


def test_create_clash_and_missing(depctl_home):
    store = SpecStore()
    store.create(make())
    with pytest.raises(ConflictError):
        store.create(make())
    with pytest.raises(NotFoundError):
        store.get("b")
    with pytest.raises(NotFoundError):
        store.delete("b")
    with pytest.raises(UsageError):
        store.get("../etc/passwd")


def test_a_deployments_recorded_prompts_go_with_it(depctl_home):
    store = SpecStore()
    store.create(make(record_prompts=True))
    assert recordings.record("a", {"prompt": "hi"}) and recordings.count("a") == 1
    assert oct(recordings.path("a").stat().st_mode & 0o777) == "0o600"  # users' text: the owner's eyes only
    store.delete("a")
    assert not recordings.path("a").exists()


def test_a_full_recording_keeps_no_more(depctl_home, monkeypatch):
    monkeypatch.setattr(recordings, "MAX_BYTES", 40)
    assert recordings.record("a", {"prompt": "0123456789"})
    assert not recordings.record("a", {"prompt": "0123456789012345678901234567890"})
    assert recordings.count("a") == 1


def test_update_revalidates_and_bumps_updated_at(depctl_home):
    store = SpecStore()
    store.create(make(speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4)))
    updated = store.update(
        "a", lambda s: s.model_copy(update={"speculation": DraftModelSpeculation(draft_model="x", num_draft_tokens=2)})
    )
    assert updated.speculation.method == "draft_model"
    assert store.get("a") == updated
    assert updated.updated_at >= updated.created_at


def test_write_is_atomic_no_temp_files_left(depctl_home, monkeypatch):
    store = SpecStore()
    store.create(make())
    before = (store.root / "a.yaml").read_text()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("depctl.store.os.replace", boom)
    with pytest.raises(OSError):
        store.update("a", lambda s: s.model_copy(update={"display_name": "new"}))
    assert (store.root / "a.yaml").read_text() == before  # the old file is intact
    assert [p.name for p in store.root.iterdir() if p.name.endswith(".tmp")] == []


def test_broken_file_is_reported_and_others_still_list(depctl_home):
    store = SpecStore()
    store.create(make("good"))
    (store.root / "bad.yaml").write_text("id: bad\nmodel: x\nspeculation: {method: ngram, ngram_length: 0}\n")
    (store.root / "worse.yaml").write_text("id: [unclosed\n")
    (store.root / "renamed.yaml").write_text("id: other\nmodel: x\n")
    specs, broken = store.list()
    assert [s.id for s in specs] == ["good"]
    problems = {b.id: b.problem for b in broken}
    assert "bad.yaml" in problems["bad"] and "ngram_length" in problems["bad"] and "num_draft_tokens" in problems["bad"]
    assert "not valid YAML" in problems["worse"]
    assert "does not match the file name" in problems["renamed"]
    with pytest.raises(SpecError, match="bad.yaml"):
        parse_spec(store.root / "bad.yaml")


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff\xfe garbage",
        b"id: a\nmodel: \xff\n",
        b"\x00" * 64,
        b"!!python/object/apply:os.system ['true']\n",
        b"a: &a [*a, *a]\n",
        b"- 1\n- 2\n",
    ],
)
def test_any_bytes_are_a_broken_spec_never_an_exception(depctl_home, content):
    # undecodable bytes once raised UnicodeDecodeError out of list(), which stopped the daemon's reconciling
    store = SpecStore()
    store.create(make("good"))
    (store.root / "s1.yaml").write_bytes(content)
    specs, broken = store.list()
    assert [s.id for s in specs] == ["good"]
    assert [b.id for b in broken] == ["s1"] and "s1.yaml" in broken[0].problem
    with pytest.raises(SpecError, match="s1.yaml"):
        store.get("s1")


def test_a_directory_or_unreadable_entry_is_a_broken_spec(depctl_home):
    store = SpecStore()
    store.create(make("good"))
    (store.root / "dir.yaml").mkdir()
    os.mkfifo(store.root / "fifo.yaml")  # opening it for reading would wait for a writer forever
    specs, broken = store.list()
    assert [s.id for s in specs] == ["good"] and [b.id for b in broken] == ["dir", "fifo"]
    assert all("not a regular file" in b.problem or "cannot be read" in b.problem for b in broken)


def _create_many(args):
    home, worker, count = args
    import os

    os.environ["DEPCTL_HOME"] = home
    store = SpecStore()
    made = 0
    for i in range(count):
        try:
            store.create(make(f"w{i}"))  # every worker races for the same ids
            made += 1
        except ConflictError:
            pass
        store.create(make(f"own-{worker}-{i}"))
    return made


def test_concurrent_writers_never_lose_or_duplicate(depctl_home):
    SpecStore()
    with mp.get_context("spawn").Pool(4) as pool:
        made = pool.map(_create_many, [(str(depctl_home), w, 10) for w in range(4)])
    specs, broken = SpecStore().list()
    assert broken == []
    assert sum(made) == 10  # each contested id was created exactly once
    assert len(specs) == 10 + 4 * 10
