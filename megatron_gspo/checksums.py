"""File checksums, one helper for every file the package checksums (checkpoints, HF exports).

SHA-256: CPUs hash it in hardware (SHA-NI, ~1-2 GB/s per core) and it is in the standard
library; it guards against bit rot and truncation, not against an attacker who can also
rewrite the record of the checksums.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHECKSUM_ALGORITHM = "sha256"


def file_checksum(path: str | os.PathLike, *, fsync: bool = False) -> str:
    """Hex checksum of a file's content, read in chunks; `fsync`: also make the file durable."""
    with open(Path(path), "rb") as handle:
        digest = hashlib.file_digest(handle, CHECKSUM_ALGORITHM).hexdigest()
        if fsync:
            os.fsync(handle.fileno())
    return digest
