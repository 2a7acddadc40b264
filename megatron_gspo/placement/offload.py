"""The trainer's state out of the compute device while colocated rollout servers hold it.

What a rank holds between two updates: its parameters, megatron DDP's gradient buffers (every
`main_grad` is a view into one) and the optimizer's state (fp32 main weights of a bf16 model,
Adam's moments). `offload` copies each distinct storage behind the parameters and the optimizer
state to host memory (pinned where CUDA is, so the copies run at full PCIe speed) and shrinks the
device storage to zero bytes; `onload` grows it back and copies the bytes in. The gradients are
dropped, not copied: every mini-batch zeroes them before its backward (`zero_grads`), so they come
back zeroed (megatron's `offload_grad_buffers` drops them too). Resizing the storage, not
replacing the tensors, keeps every view, every optimizer reference and every DDP bucket pointing
at the same memory, so nothing else has to know the state went away.

A shrunk storage's memory goes back to this process's caching allocator, not to the driver, and
SGLang's memory saver cannot use memory another process holds reserved: after a CUDA offload
`torch.cuda.empty_cache()` hands the freed segments back (as megatron's offload does). Pinned host
copies come from torch's pinned host allocator, which rounds every request up to a power of two
(`CachingHostAllocator`: `PowerOf2Ceil`): `host_nbytes` counts them so.

On a CPU-only run the compute device is the host: a storage already in host memory has nowhere
to go and stays where it is, so offload and onload leave every byte in place.
"""

from __future__ import annotations

import torch

from megatron_gspo.model.chunks import model_chunks

HOST = torch.device("cpu")


def trainer_state_tensors(ddp_model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """Every tensor of a rank's training state: parameters, gradient buffers, optimizer state."""
    tensors: list[torch.Tensor] = []
    for chunk in model_chunks(ddp_model):
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
        for param in chunk.parameters():
            tensors += [t for t in (param, getattr(param, "main_grad", None), param.grad) if t is not None]
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            tensors += [p for p in group["params"]] + [p.grad for p in group["params"] if p.grad is not None]
        for state in inner.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def gradient_tensors(ddp_model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """The gradients among `trainer_state_tensors`: DDP's gradient buffers and every `.grad`/`main_grad`."""
    tensors: list[torch.Tensor] = []
    for chunk in model_chunks(ddp_model):
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            tensors += [buffer.grad_data] if buffer.grad_data is not None else []
        for param in chunk.parameters():
            tensors += [t for t in (getattr(param, "main_grad", None), param.grad) if t is not None]
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            tensors += [p.grad for p in group["params"] if p.grad is not None]
    return tensors


def pinned_host_bytes(nbytes: int) -> int:
    """Host memory a pinned request of `nbytes` takes: torch's pinned allocator rounds to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def weight_tensors(ddp_model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of a rank's model (and DDP's buffers they are views of): what a weight sync reads."""
    tensors: list[torch.Tensor] = []
    for chunk in model_chunks(ddp_model):
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            tensors += [buffer.param_data] if buffer.param_data is not None else []
        tensors += list(chunk.parameters())
    return tensors


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers under megatron's (chained, mixed-precision, distributed) wrappers."""
    if optimizer is None:
        return []
    inner = []
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(megatron_optimizer, "optimizer", None)
        if torch_optimizer is not None:
            inner.append(torch_optimizer)
    return inner


class ParkedStorages:
    """Distinct device storages behind a set of tensors, moved to host memory and back whole.

    Args:
        tensors: views of the storages to park (several may share one storage).
        host: where parked bytes live (the host).
        include_host: park storages already in host memory too (a copy and a resize in place:
            how the tests run the GPU's path on a CPU).
        leave: views of storages to leave where they are.
        drop: views of storages to shrink without a copy and bring back zeroed (gradients).
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        host: torch.device = HOST,
        *,
        include_host: bool = False,
        leave: list[torch.Tensor] = (),
        drop: list[torch.Tensor] = (),
    ) -> None:
        self.host = host
        left = {_storage_key(t.untyped_storage()) for t in leave}
        dropped = _distinct(drop, host, include_host, left)
        self._storages = list(_distinct(tensors, host, include_host, left | set(dropped)).values())
        self._dropped = list(dropped.values())
        self._nbytes = [storage.nbytes() for storage in self._storages]
        self._dropped_nbytes = [storage.nbytes() for storage in self._dropped]
        self._pin = torch.cuda.is_available()
        self._parked: list[torch.Tensor] = []
        self._offloaded = False

    @property
    def nbytes(self) -> int:
        """Bytes copied to the host by one offload (0 when everything already lives in host memory)."""
        return sum(self._nbytes)

    @property
    def dropped_nbytes(self) -> int:
        """Device bytes given back by one offload without a copy (the gradients)."""
        return sum(self._dropped_nbytes)

    @property
    def host_nbytes(self) -> int:
        """Host memory the copies take: pinned ones as the pinned allocator rounds them."""
        return sum(pinned_host_bytes(n) if self._pin else n for n in self._nbytes)

    @property
    def offloaded(self) -> bool:
        """Whether the storages are in host memory (or dropped) now."""
        return self._offloaded

    @torch.no_grad()
    def offload(self) -> None:
        """Copy every kept storage to host memory, then give its and the dropped ones' device memory back."""
        if self._offloaded or not (self._storages or self._dropped):
            return
        for storage, nbytes in zip(self._storages, self._nbytes):
            parked = torch.empty(nbytes, dtype=torch.uint8, device=self.host, pin_memory=self._pin)
            parked.copy_(_bytes_of(storage), non_blocking=self._pin)
            self._parked.append(parked)
        if self._pin:
            torch.cuda.synchronize()  # the copies are done before the memory is freed
        for storage in self._storages + self._dropped:
            storage.resize_(0)
        self._offloaded = True
        if any(storage.device.type == "cuda" for storage in self._storages + self._dropped):
            torch.cuda.empty_cache()  # the freed segments back to the driver, for SGLang's memory saver

    @torch.no_grad()
    def onload(self) -> None:
        """Grow every storage back on its device: the kept ones' bytes copied in, the dropped ones zeroed."""
        if not self._offloaded:
            return
        for storage, nbytes, parked in zip(self._storages, self._nbytes, self._parked):
            storage.resize_(nbytes)
            _bytes_of(storage).copy_(parked, non_blocking=True)
        for storage, nbytes in zip(self._dropped, self._dropped_nbytes):
            storage.resize_(nbytes)
            _bytes_of(storage).zero_()
        if self._pin:
            torch.cuda.synchronize()  # the host copies may be dropped (and their pages reused)
        self._parked = []
        self._offloaded = False


def _distinct(
    tensors: list[torch.Tensor], host: torch.device, include_host: bool, skip: set[tuple[str, int]]
) -> dict[tuple[str, int], torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (keyed by device and address), less `skip`."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = _storage_key(storage)
        if (include_host or storage.device != host) and storage.nbytes() and key not in skip:
            seen.setdefault(key, storage)
    return seen


def _storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return str(storage.device), storage.data_ptr()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TrainerOffload:
    """A rank's training state parked in host memory around generation (`rollout.placement: colocated`).

    Built once the optimizer exists (its state tensors are created lazily at its first step, so
    the set is taken again at each offload). The weights can stay behind the rest
    (`keep_weights`): a weight sync after training reads them, as verl's and slime's hand-overs
    sync before they offload the parameters.

    Args:
        include_host: park host storages too (how the tests run the GPU's path on a CPU).
    """

    def __init__(self, ddp_model: torch.nn.Module, optimizer, *, include_host: bool = False) -> None:
        self.model, self.optimizer, self.include_host = ddp_model, optimizer, include_host
        self._rest: ParkedStorages | None = None
        self._weights: ParkedStorages | None = None

    @property
    def host_nbytes(self) -> int:
        """Host memory the parked state takes now (pinned copies as the pinned allocator rounds them)."""
        return sum(parked.host_nbytes for parked in (self._rest, self._weights) if parked is not None)

    def offload(self, *, keep_weights: bool = False) -> int:
        """Move the state to host memory (gradients dropped); returns the bytes copied now (0 on CPU).

        Args:
            keep_weights: leave the parameters on the device (a later `offload()` moves them).
        """
        moved = 0
        weights = weight_tensors(self.model)
        if self._rest is None:
            state = trainer_state_tensors(self.model, self.optimizer)
            grads = gradient_tensors(self.model, self.optimizer)
            self._rest = ParkedStorages(state, include_host=self.include_host, leave=weights, drop=grads)
            self._rest.offload()
            moved += self._rest.nbytes
        if not keep_weights and self._weights is None:
            self._weights = ParkedStorages(weights, include_host=self.include_host)
            self._weights.offload()
            moved += self._weights.nbytes
        return moved

    def onload(self) -> None:
        """Bring the state back to the compute device for training."""
        for parked in (self._weights, self._rest):
            if parked is not None:
                parked.onload()
        self._weights = self._rest = None
