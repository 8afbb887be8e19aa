"""A learning head's data: what the target computed while it served the deployment's own requests.

``TrafficRecorder`` is the engine's observer (``proposers.FeatureObserver``): it holds the layer features of every
position each running sequence has read, as the passes computed them (the prompt's and the accepted tokens'), and on
a finished answer hands tokens and features to the ``TrafficStore``. Nothing is computed for it: the features are the
ones the target returns for the head anyway, and the labels are the tokens the target chose (no logits are taken: a
top-16 of a position's logits costs a step at one row 1-2%). Answers generated in idle time also keep the target's
distribution at each answer position (``answers.IdleAnswers``), which training learns instead of the token chosen.
The features of a sequence under way also seed a new head generation's rows (``SpeculativeEngine.swap_proposer``).

The store is a folder of the deployment's own (mode 0700, each file 0600: users' text and the states it produced),
one safetensors file per answer, written in idle time, oldest deleted first beyond a disk budget, and deleted with
the deployment (``depctl.learning``). Answers the deployment generated itself in idle time (``answers.IdleAnswers``)
may fill ``IDLE_SHARE`` of the budget, the oldest of them making room for the next: the rest is the traffic's.

One prompt in ``HELD_OUT_EVERY`` is held out, chosen by a hash of its tokens: the most recent answers to those
measure a candidate head against the serving one, and none is trained on. Held out by prompt, not by answer: a prompt
asked again (a retry, a sampled answer, a shipped prompt answered in idle time and then by a client) gives nearly or
exactly the answer it gave before, and a head measured on answers it had trained on under other numbers looks far
better than it drafts on prompts it never saw.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HELD_OUT_EVERY = 8  # one prompt in eight measures heads and is never trained on
HELD_OUT_KEPT = 32  # the most recent held-out answers a comparison reads
MIN_ANSWER = 8  # output tokens below which an answer teaches too little to keep
PENDING_BYTES = 64 << 20  # finished answers waiting for idle time to be written; the oldest dropped beyond
IDLE_SHARE = 0.5  # of the disk budget: what answers generated in idle time may fill


@dataclass
class Top:
    """The target's most likely tokens (``ids`` [R, TOP_K] int32) and their log-probabilities (``logp``, float16) at
    positions ``first .. first + R - 1`` of an answer: the distribution each token after them was drawn from."""

    ids: torch.Tensor
    logp: torch.Tensor
    first: int

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.logp.nbytes


@dataclass
class Answer:
    """One finished sequence as training reads it: ``tokens`` [n] (prompt and answer, its stop token included),
    ``features`` [n - 1, F] (position i's predict token i + 1), ``prompt_len``; ``idle``: generated in idle time, not
    served; ``top``: the target's distribution at the answer's positions (from the prompt's last), where it was
    kept."""

    tokens: torch.Tensor
    features: torch.Tensor
    prompt_len: int
    idle: bool = False
    top: Top | None = None

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.features.nbytes + (self.top.nbytes if self.top is not None else 0)

    def example(self) -> dict:
        """The shape ``training.eagle`` reads (``start``: the first answer token)."""
        return {"tokens": self.tokens, "features": self.features, "start": self.prompt_len}

    @property
    def held_out(self) -> bool:
        """Whether this answer's prompt is one of those held out: every answer to the same prompt agrees."""
        prompt = self.tokens[: self.prompt_len].to(torch.int32).numpy().tobytes()
        return zlib.crc32(prompt) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


class TrafficRecorder:
    """The engine's observer: each running sequence's features, kept until it finishes."""

    needs_prompt_features = True  # every prompt position's: a deployment that learns reads prompts whole

    def __init__(self, store: TrafficStore, dtype: torch.dtype = torch.bfloat16):
        self.store = store
        self.dtype = dtype  # half of float32's bytes: an answer's features are [tokens, 3 * hidden]
        self._seqs: dict[int, list[torch.Tensor]] = {}

    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None:
        self._keep(seq, features)

    def accepted(self, seq, before: int, emitted, drafted, features: torch.Tensor | None, logits=None) -> None:
        self._keep(seq, features)

    def _keep(self, seq, features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("a learning head needs the target's layer features: load the target with its layers")
        self._seqs.setdefault(seq.id, []).append(features.to(device="cpu", dtype=self.dtype))

    def features(self, seq) -> torch.Tensor | None:
        """[positions read, F]: every position of ``seq`` the target has read so far (None before any)."""
        kept = self._seqs.get(seq.id)
        return torch.cat(kept) if kept else None

    def finished(self, seq) -> None:
        kept = self._seqs.pop(seq.id, None)
        if kept is None or seq.fault is not None or seq.finish_reason not in ("stop", "length"):
            return
        n = seq.answered  # a step may have accepted drafts past the stop token: not part of the answer
        if n - seq.prompt_len < MIN_ANSWER:
            return
        features = torch.cat(kept)[: n - 1]
        self.store.put(Answer(torch.tensor(seq.tokens[:n], dtype=torch.int32), features, seq.prompt_len))

    def release(self) -> None:
        self._seqs.clear()


class TrafficStore:
    """A deployment's recorded answers on disk (``folder``), within ``budget`` bytes, those generated in idle time
    within ``idle_share`` of it."""

    def __init__(self, folder: Path, budget: int, idle_share: float = IDLE_SHARE):
        self.folder = folder
        self.budget = budget
        self.idle_share = idle_share
        private_dir(folder)
        self._pending: deque[Answer] = deque()
        self._pending_bytes = 0
        self._files = sorted(folder.glob("*.safetensors"), key=_number)
        self._next = _number(self._files[-1]) + 1 if self._files else 0
        self.bytes = sum(p.stat().st_size for p in self._files)
        self.idle_bytes = sum(p.stat().st_size for p in self._files if _idle(p))
        self.dropped = 0  # answers not kept: waiting too long for idle time, or evicted by the budget
        self.positions_written = 0  # tokens of the training answers written since this store opened

    # ---- the engine thread, while serving: in memory only ----
    @property
    def pending_bytes(self) -> int:
        """Bytes of the answers waiting in memory to be written."""
        return self._pending_bytes

    def put(self, answer: Answer) -> None:
        self._pending.append(answer)
        self._pending_bytes += answer.nbytes
        while self._pending_bytes > PENDING_BYTES and len(self._pending) > 1:
            self._pending_bytes -= self._pending.popleft().nbytes
            self.dropped += 1

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # ---- idle time ----
    def flush_one(self) -> Path | None:
        """Write the oldest waiting answer (then evict the oldest files beyond the budget, and the oldest idle-time
        answers beyond their share); its path. A training answer's positions are added to ``positions_written``."""
        if not self._pending:
            return None
        answer = self._pending.popleft()
        self._pending_bytes -= answer.nbytes
        number = self._next
        self._next += 1
        kind = "held" if answer.held_out else "train"
        path = self.folder / f"{kind}-{number}{'-idle' if answer.idle else ''}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        tensors = {"tokens": answer.tokens, "features": answer.features.contiguous()}
        if answer.top is not None:  # (its rows start at the prompt's last position)
            tensors.update(top_ids=answer.top.ids.contiguous(), top_logp=answer.top.logp.contiguous())
        save_file(tensors, str(tmp), metadata={"prompt_len": str(answer.prompt_len)})
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        self._files.append(path)
        size = path.stat().st_size
        self.bytes += size
        self.idle_bytes += size if answer.idle else 0
        if kind == "train":
            self.positions_written += len(answer.tokens)
        while self.bytes > self.budget and len(self._files) > 1:
            self._evict(self._files[0])
        while self.idle_bytes > self.idle_share * self.budget:
            oldest = next(p for p in self._files if _idle(p))
            if oldest == path:
                break  # the one just written stays: it is what the next comparison or window reads
            self._evict(oldest)
        return path

    def _evict(self, path: Path) -> None:
        self._files.remove(path)
        size = path.stat().st_size
        self.bytes -= size
        self.idle_bytes -= size if _idle(path) else 0
        path.unlink(missing_ok=True)
        self.dropped += 1

    def positions_on_disk(self) -> int:
        """The tokens of the training answers on disk (their headers only)."""
        total = 0
        for path in self.training_files():
            try:
                with safe_open(str(path), framework="pt") as f:
                    total += f.get_slice("tokens").get_shape()[0]
            except Exception:  # noqa: BLE001 - a file cut short counts for nothing
                continue
        return total

    def training_files(self) -> list[Path]:
        return [p for p in self._files if p.name.startswith("train-")]

    def held_out_files(self) -> list[Path]:
        return [p for p in self._files if p.name.startswith("held-")][-HELD_OUT_KEPT:]

    def counts(self) -> dict:
        return {
            "answers": len(self._files),
            "held_out": sum(p.name.startswith("held-") for p in self._files),
            "bytes": self.bytes,
            "budget_bytes": self.budget,
            "waiting": len(self._pending),
            "dropped": self.dropped,
        }


def read_answer(path: Path) -> Answer | None:
    """An answer file, or None where it is gone (evicted) or was cut short."""
    try:
        with safe_open(str(path), framework="pt") as f:
            prompt_len = int(f.metadata()["prompt_len"])
            top = None
            if "top_ids" in f.keys():
                top = Top(f.get_tensor("top_ids"), f.get_tensor("top_logp"), prompt_len - 1)
            return Answer(f.get_tensor("tokens"), f.get_tensor("features"), prompt_len, _idle(path), top)
    except Exception:  # noqa: BLE001 - a file evicted meanwhile, or not one this code wrote: skipped
        return None


def read_tokens(path: Path) -> tuple[torch.Tensor, int] | None:
    """An answer file's tokens and prompt length without its features (a hundredth of its bytes), or None as
    ``read_answer``."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("tokens"), int(f.metadata()["prompt_len"])
    except Exception:  # noqa: BLE001 - as read_answer
        return None


def private_dir(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def _number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _idle(path: Path) -> bool:
    """Whether the file holds an answer generated in idle time (``train-N-idle``, ``held-N-idle``)."""
    return path.stem.endswith("-idle")
