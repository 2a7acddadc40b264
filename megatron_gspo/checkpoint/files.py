"""Durable, checksummed files of a training checkpoint.

Every file is fsynced before the checkpoint is published, and its SHA-256 is computed while
it is written (the bytes pass through the hash on their way to the file: no second read);
files another writer produced are hashed by `megatron_gspo.checksums` (SHA-256, see there).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.checksums import CHECKSUM_ALGORITHM, file_checksum


class _HashingWriter:
    """A write-only file object that hashes and counts every byte it forwards."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self.digest = hashlib.new(CHECKSUM_ALGORITHM)
        self.size = 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_durably(obj: Any, path: Path) -> tuple[int, str]:
    """`torch.save` `obj` to `path`, fsync it, and return (size in bytes, hex checksum)."""
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        os.fsync(handle.fileno())
    return writer.size, writer.digest.hexdigest()


def durable_checksum(path: Path) -> tuple[int, str]:
    """Size in bytes and hex checksum of a file another writer produced, fsyncing it too."""
    digest = file_checksum(path, fsync=True)
    return path.stat().st_size, digest


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees either the old or the new content, durably."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def meta_checksum(meta: dict[str, Any]) -> str:
    """Checksum of a `meta.json` document without its own `meta_checksum` field.

    Computed over a canonical JSON form (sorted keys) of what a reader parses back, so writer
    and reader agree however the file was indented.
    """
    body = {key: value for key, value in meta.items() if key != "meta_checksum"}
    canonical = json.dumps(json.loads(json.dumps(body, default=str)), sort_keys=True)
    return hashlib.new(CHECKSUM_ALGORITHM, canonical.encode()).hexdigest()


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write `meta` (plus its own checksum) as JSON and fsync it."""
    document = {**meta, "meta_checksum": meta_checksum(meta)}
    with open(path, "w") as handle:
        handle.write(json.dumps(document, indent=2, default=str))
        handle.flush()
        os.fsync(handle.fileno())
