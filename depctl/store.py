"""The spec store: one YAML file per deployment under ``$DEPCTL_HOME/deployments``.

Writes are atomic (temp file in the same directory, fsync, ``os.replace``) and every read-modify-write holds a
file lock, so two CLI calls at once never corrupt a file, lose a deployment or create the same id twice.
A hand-broken file is reported with its path and problem and never hides the other deployments.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import yaml
from filelock import FileLock
from pydantic import ValidationError

from depctl import config, learning, recordings
from depctl.errors import ConflictError, NotFoundError, SpecError, UsageError
from depctl.spec import DeploymentSpec, check_deployment_id


@dataclass(frozen=True)
class BrokenSpec:
    id: str  # the file's stem
    path: Path
    problem: str


def _format_validation(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors())


def parse_spec(path: Path) -> DeploymentSpec:
    """Read and validate one spec file, or raise ``SpecError`` naming the file and every problem.

    Whatever the file holds (binary junk, a FIFO, a directory, a YAML bomb), the answer is a spec or a ``SpecError``:
    the daemon's reconciling and ``list`` read every file, so one bad file must never raise anything else."""
    try:
        with open(path, "rb", opener=_open_nonblocking) as fh:
            if not os.path.isfile(path):
                raise SpecError(f"{path}: not a regular file; remove it (`rm {path}`)")
            data = fh.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES // 1024} KB; a spec is a few hundred bytes")
        raw = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start}); fix it or delete the deployment") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of fields, found {type(raw).__name__}")
    try:
        spec = DeploymentSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{path}: {_format_validation(exc)}") from None
    if spec.id != path.stem:
        raise SpecError(f"{path}: id {spec.id!r} does not match the file name {path.stem!r}")
    return spec


MAX_SPEC_BYTES = 64 * 1024


def _open_nonblocking(path, flags):
    # O_NONBLOCK: opening a FIFO someone named *.yaml returns at once instead of waiting for a writer
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


class SpecStore:
    def __init__(self, root: Path | None = None):
        self.root = root or config.deployments_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(str(self.root / ".lock"), timeout=30)

    def path(self, deployment_id: str) -> Path:
        try:
            check_deployment_id(deployment_id)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return self.root / f"{deployment_id}.yaml"

    # ---- reads (lock-free: files are replaced atomically) ----
    def list(self) -> tuple[list[DeploymentSpec], list[BrokenSpec]]:
        specs, broken = [], []
        for path in sorted(self.root.glob("*.yaml")):
            try:
                specs.append(parse_spec(path))
            except SpecError as exc:
                broken.append(BrokenSpec(path.stem, path, exc.message))
            except Exception as exc:  # noqa: BLE001 - parse_spec maps every known failure; this keeps the promise
                broken.append(BrokenSpec(path.stem, path, f"{path}: {type(exc).__name__}: {exc}"))
        specs.sort(key=lambda s: (s.created_at, s.id))
        return specs, broken

    def get(self, deployment_id: str) -> DeploymentSpec:
        path = self.path(deployment_id)
        if not path.exists():
            raise NotFoundError(
                f"deployment {deployment_id!r} not found", "list deployments with `depctl deployment list`"
            )
        return parse_spec(path)

    def fingerprint(self) -> dict[str, tuple[int, int]]:
        """{file stem: (mtime_ns, size)}: cheap change detection for the daemon's poll."""
        out = {}
        for path in self.root.glob("*.yaml"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out[path.stem] = (st.st_mtime_ns, st.st_size)
        return out

    # ---- writes (locked, atomic) ----
    def check_new(self, deployment_id: str) -> None:
        """Refuse an id that is taken, as ``create`` would (``--validate-only`` asks the same question)."""
        if self.path(deployment_id).exists():
            raise ConflictError(
                f"deployment {deployment_id!r} already exists",
                "pick another --deployment-id, or change it with `depctl deployment update`",
            )

    def create(self, spec: DeploymentSpec) -> DeploymentSpec:
        with self._lock:
            self.check_new(spec.id)
            self._write(self.path(spec.id), spec)
        return spec

    def update(self, deployment_id: str, change: Callable[[DeploymentSpec], DeploymentSpec]) -> DeploymentSpec:
        with self._lock:
            current = self.get(deployment_id)
            updated = change(current).model_copy(
                update={"updated_at": datetime.now(timezone.utc).replace(microsecond=0)}
            )
            # re-validate: model_copy does not run validators
            updated = DeploymentSpec.model_validate(updated.model_dump())
            self._write(self.path(deployment_id), updated)
        return updated

    def delete(self, deployment_id: str) -> None:
        with self._lock:
            path = self.path(deployment_id)
            if not path.exists():
                raise NotFoundError(
                    f"deployment {deployment_id!r} not found", "list deployments with `depctl deployment list`"
                )
            path.unlink()
            recordings.delete(deployment_id)  # the prompts it recorded go with it
            learning.delete(deployment_id)  # and the traffic and heads a learning head kept

    def _write(self, path: Path, spec: DeploymentSpec) -> None:
        text = yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
