"""SGLang's memory occupation API (`--enable-memory-saver`): weights and KV cache released and resumed.

SGLang 0.5.23 (`scheduler_components/weight_updater.py`, `release_memory_occupation` /
`resume_memory_occupation`) pauses torch_memory_saver regions by tag: `kv_cache` (its token pool),
`weights` (everything allocated while the model loaded) and `cuda_graph`; no tags means all three.
The physical memory goes back to the device; the tensors keep their shapes and addresses. On
resume the memory comes back *without its contents* unless the server has
`--enable-weights-cpu-backup`: the weights are whatever the new pages hold until a weight
update writes them.

Here, on CPU, the same happens to host memory: released weights give up their storage (each
parameter keeps its shape and dtype, its data becomes an empty tensor, and glibc is asked to
hand the freed pages back, so the process's RSS drops); resumed weights get fresh storage filled
with NaN (SGLang's contents are undefined; NaN makes a forgotten update visible), and generation
is refused until a weight update has made every parameter finite again. The KV cache of a batch
lives only while the batch runs (`engine.py`); what SGLang holds between batches is its
preallocated token pool, stood in for by a reservation of `--kv-pool-mb` MiB, allocated at start
and on resume, freed on release.

Where SGLang crashes or hangs, this refuses with a named error instead (docs/sglang-conformance.md):
- release while requests run: SGLang's assertion kills its scheduler; here a 400 `ServerBusy`.
- /generate (or a weight update) while `weights` / `kv_cache` are released: SGLang runs the
  forward on unmapped memory (an illegal-address crash on GPU); here a 400 `MemoryReleased`.
- resume of a tag not released: SGLang's `offload_tags.remove` raises KeyError in its scheduler;
  here a 400 `MemoryNotReleased`. Releasing a tag twice: a 400 `MemoryReleased`.
- without `--enable-memory-saver` SGLang answers 200 and frees nothing (its no-op adapter); here
  a 400 `MemorySaverDisabled`, since a colocated trainer would then run out of memory later.
- a tag outside SGLang's three (which SGLang ignores): a 400 naming the known tags.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Iterable

import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""SGLang's `GPU_MEMORY_ALL_TYPES`, in its order: what no tags (or an empty list) means."""


class MemoryOccupationError(RuntimeError):
    """A memory call, generation or weight update refused; `name` is the error's name in its message."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


def check_tags(tags: object) -> tuple[str, ...]:
    """The tags of a release/resume body (None or [] -> all of SGLang's), or ValueError naming the bad one."""
    if tags is None:
        return ALL_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings (subset of {list(ALL_TAGS)}), got {tags!r}")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"tags: unknown memory tag(s) {unknown}; SGLang's are {list(ALL_TAGS)}")
    return tuple(dict.fromkeys(tags)) or ALL_TAGS


def _trim_host_heap() -> None:
    """Ask glibc to return freed heap pages to the OS (freed small blocks otherwise stay in RSS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


class MemoryOccupation:
    """Which of the server's memory regions are released, and the release/resume of each.

    Thread safety: the caller holds the engine's lock (no forward runs meanwhile).
    """

    def __init__(self, model: torch.nn.Module, *, enabled: bool, kv_pool_bytes: int = 0):
        self.model = model
        self.enabled = enabled
        """The server was started with `--enable-memory-saver`."""
        self.kv_pool_bytes = int(kv_pool_bytes)
        self.released: set[str] = set()
        self.weights_unset = False
        """Weights resumed (NaN) and not yet all written by a weight update."""
        self._shapes: dict[str, torch.Size] = {}
        self._kv_pool: torch.Tensor | None = None
        self._lock = threading.Lock()
        if enabled:
            self._own_weights()
        self._allocate_kv_pool()

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ calls
    def release(self, tags: Iterable[str]) -> None:
        """Free the regions of `tags` (checked by `check_tags`); refuses a tag already released."""
        tags = tuple(tags)
        with self._lock:
            self._require_enabled("release_memory_occupation")
            again = [t for t in tags if t in self.released]
            if again:
                raise MemoryOccupationError(
                    "MemoryReleased", f"{again} already released; resume_memory_occupation first"
                )
            if KV_CACHE in tags:
                self._kv_pool = None
            if WEIGHTS in tags:
                self._release_weights()
            self.released.update(tags)
            self._return_memory()

    def resume(self, tags: Iterable[str]) -> None:
        """Re-allocate the regions of `tags`; weights come back as NaN until a weight update."""
        tags = tuple(tags)
        with self._lock:
            self._require_enabled("resume_memory_occupation")
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise MemoryOccupationError(
                    "MemoryNotReleased", f"{missing} not released (released now: {sorted(self.released)})"
                )
            if WEIGHTS in tags:
                self._resume_weights()
            if KV_CACHE in tags:
                self._allocate_kv_pool()
            self.released.difference_update(tags)

    def check_generation(self) -> None:
        """Raise `MemoryOccupationError` unless a forward may run now."""
        held = sorted(self.released)
        if held:
            raise MemoryOccupationError(
                "MemoryReleased",
                f"cannot generate while {held} are released; POST /resume_memory_occupation first",
            )
        if self.weights_unset:
            raise MemoryOccupationError(
                "WeightsNotLoaded",
                "weights were resumed without their contents (SGLang keeps none without "
                "--enable-weights-cpu-backup); update every weight before generating",
            )

    def check_update(self) -> None:
        """Raise `MemoryOccupationError` if a weight update cannot land (the weights are released)."""
        if WEIGHTS in self.released:
            raise MemoryOccupationError(
                "MemoryReleased",
                "cannot update weights while they are released; POST /resume_memory_occupation "
                'with tags ["weights"] first',
            )

    def after_update(self) -> None:
        """After a weight update: generation may go on once no resumed parameter is NaN any more."""
        if self.weights_unset:
            self.weights_unset = not all(
                bool(torch.isfinite(p).all()) for p in self.model.parameters() if p.is_floating_point()
            )

    def kv_pool_allocated_bytes(self) -> int:
        """Bytes the KV pool reservation holds now (0 while released)."""
        return 0 if self._kv_pool is None else self._kv_pool.numel()

    # ----------------------------------------------------------------- memory
    def _require_enabled(self, call: str) -> None:
        if not self.enabled:
            raise MemoryOccupationError(
                "MemorySaverDisabled",
                f"{call} needs a server started with --enable-memory-saver (SGLang without it "
                "answers 200 and frees nothing)",
            )

    def _own_weights(self) -> None:
        # transformers maps the safetensors file (copy-on-write): pages of it are resident only once
        # read and leave RSS only as file cache. Private copies hold the weights as SGLang's device
        # memory does, all resident, so what a release frees shows in the process's RSS.
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = param.data.clone()

    def _release_weights(self) -> None:
        # Parameters keep their identity (modules and hooks hold them); only the storage goes.
        for name, param in self.model.named_parameters():
            self._shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _resume_weights(self) -> None:
        for name, param in self.model.named_parameters():
            fill = float("nan") if param.is_floating_point() else 0
            param.data = torch.full(self._shapes[name], fill, dtype=param.dtype, device=param.device)
        self._shapes.clear()
        self.weights_unset = True

    def _allocate_kv_pool(self) -> None:
        if self.kv_pool_bytes > 0:
            # zeros, not empty: the pages are touched, so they count in RSS as SGLang's pool does on GPU.
            self._kv_pool = torch.zeros(self.kv_pool_bytes, dtype=torch.uint8, device=self.device)

    def _return_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_host_heap()
