"""Integrity of what a run reads back: a sha256 per file, recorded when it is written and checked
before the file is used; a mismatch is one line naming the file.

Idea: a torch file whose *data* has a flipped byte loads without a word (its zip directory is
checked, the tensors' bytes are not), and a JSON file can change a number and stay valid JSON.
So every file zerolab writes and later reads back carries a content hash, recorded where the
reader looks before it uses the file:

- a checkpoint's rank files: meta.json "sha256" {file: hex}; each rank hashes its file while
  torch.save writes it (`HashingWriter`);
- a checkpoint's meta.json: "sealed", the sha256 of its own other content (`seal`), so a step
  folder opened directly is checked too; `latest` names the step folder *and* meta.json's sha256
  (`pointer`), so a changed pointer cannot silently name another checkpoint;
- consolidated exports (model.pt, --optimizer, --safetensors): NAME.sha256 beside each, in
  `sha256sum` format (`sha256sum -c model.pt.sha256` checks it; `check_sidecar` in Python);
- saved parameters (params.pt): rank0.json's params_sha256 (zerolab.course.results checks it);
- the committed reference runs: reference_runs/SHA256SUMS (zerolab.course.reference).

A mismatch raises `IntegrityError` (a ValueError, so every door prints it as one line):

    checkpoint '.../step_000004': rank1.pt differs from the sha256 recorded when it was
    written (damaged or altered since); resume from an earlier checkpoint, or rerun
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

CHUNK = 1 << 20
SEAL = "sealed"                 # meta.json's key for the sha256 of its own other content
_POINTER = re.compile(r"(step_\d+)\nmeta\.json sha256 ([0-9a-f]{64})\n")
_LEGACY_POINTER = re.compile(r"step_\d+")        # format 2 and before: the folder name only


class IntegrityError(ValueError):
    """A file differs from the sha256 recorded when it was written (one line naming it)."""


def sha256_file(path) -> str:
    """The sha256 (hex) of the file at `path`, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_file(path, expected: str, where: str, todo: str):
    """IntegrityError unless the file at `path` has sha256 `expected`. where: how the message
    names the file's place (e.g. "checkpoint '/x/step_000004': "); todo: what to do instead."""
    path = Path(path)
    if sha256_file(path) != expected:
        raise IntegrityError(f"{where}{path.name} differs from the sha256 recorded when it was "
                             f"written (damaged or altered since); {todo}")


class HashingWriter:
    """A binary file for torch.save that hashes every byte it writes and keeps the OSError a
    write raised (`error`): torch.save turns a full disk into "unexpected pos ..."."""

    def __init__(self, f):
        self.f, self.h, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.h.update(data)
        return n

    def flush(self):
        self.f.flush()

    def hexdigest(self) -> str:
        return self.h.hexdigest()


# --- JSON manifests that carry their own hash ------------------------------------------------
def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def seal(obj: dict) -> dict:
    """`obj` plus SEAL: the sha256 of its other content (canonical JSON: sorted keys, no
    spaces), so any change to a value, a key or the seal itself is seen by `check_seal`."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return {**body, SEAL: sha256_bytes(_canonical(body))}


def check_seal(obj: dict, where: str, todo: str):
    """IntegrityError unless `obj` (a parsed JSON manifest) holds a SEAL matching its content."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    if obj.get(SEAL) != sha256_bytes(_canonical(body)):
        raise IntegrityError(f"{where}differs from the sha256 recorded when it was written "
                             f"(damaged or altered since); {todo}")


# --- a pointer file: a step folder's name and its manifest's sha256 ----------------------------
def pointer(name: str, manifest_sha256: str) -> str:
    """The text of `latest`: 'step_000008\\nmeta.json sha256 <hex>\\n'."""
    return f"{name}\nmeta.json sha256 {manifest_sha256}\n"


def read_pointer(text: str, where: str) -> tuple[str, str | None]:
    """(folder name, meta.json's sha256, or None for a pointer of format 2 and before, which
    held the name only). IntegrityError (one line) for any other text: a damaged pointer."""
    m = _POINTER.fullmatch(text)
    if m:
        return m.group(1), m.group(2)
    if _LEGACY_POINTER.fullmatch(text.strip()):
        return text.strip(), None
    raise IntegrityError(f"{where}is damaged: it should name a step_* folder and its meta.json's "
                         "sha256; open a step_* folder directly, or rerun")


# --- exports: NAME.sha256 beside the file (sha256sum format) -----------------------------------
def sidecar(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def sidecar_text(path, digest: str) -> str:
    """What `sha256sum NAME` prints: '<hex>  NAME\\n' (so `sha256sum -c NAME.sha256` checks it)."""
    return f"{digest}  {Path(path).name}\n"


def check_sidecar(path) -> bool:
    """Check the file at `path` against NAME.sha256 beside it: True when it matches, False when
    there is no NAME.sha256; IntegrityError (one line) when the file or its record differ."""
    side = sidecar(path)
    if not side.exists():
        return False
    m = re.fullmatch(r"([0-9a-f]{64})  (.+)\n", side.read_text(errors="replace"))
    if not m or m.group(2) != Path(path).name:
        raise IntegrityError(f"{side}: damaged (expected '<sha256>  {Path(path).name}'); write "
                             "the export again")
    check_file(path, m.group(1), f"{Path(path).parent}/",
               "write the export again (zerolab checkpoint consolidate)")
    return True
