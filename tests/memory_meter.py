"""Peak host memory of a block of code, read from glibc's allocator (Linux only).

torch's CPU tensors come from malloc (large ones as mmapped blocks), so the bytes glibc has
handed out and not taken back, sampled after every torch op of the measuring thread, include
every tensor the code holds at that op. Python objects (pymalloc arenas) are not counted.
"""

import ctypes
import sys

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads glibc's allocator statistics")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def bytes_in_use() -> int:
    """Bytes glibc's allocator has handed out: heap chunks in use + mmapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMemory(TorchDispatchMode):
    """Bytes in use sampled after every torch op (this thread): `extra` is the peak beyond the start."""

    def __enter__(self):
        self.start = self.peak = bytes_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, bytes_in_use())
        return out

    @property
    def extra(self) -> int:
        """Peak bytes beyond those in use on entry."""
        return self.peak - self.start
