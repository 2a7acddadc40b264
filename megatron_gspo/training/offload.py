"""The trainer's state out of the compute device while colocated rollout servers hold it.

What a rank holds between two updates: its parameters, megatron DDP's gradient buffers (every
`main_grad` is a view into one) and the optimizer's state (fp32 main weights of a bf16 model,
Adam's moments). `offload` copies each distinct storage behind those tensors to host memory
(pinned where CUDA is, so the copies run at full PCIe speed) and shrinks the device storage to
zero bytes; `onload` grows it back and copies the bytes in. Resizing the storage, not replacing
the tensors, keeps every view, every optimizer reference and every DDP bucket pointing at the
same memory, so nothing else has to know the state went away.

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
    """

    def __init__(
        self, tensors: list[torch.Tensor], host: torch.device = HOST, *, include_host: bool = False
    ) -> None:
        self.host = host
        seen: dict[tuple[str, int], torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if (include_host or storage.device != host) and storage.nbytes():
                seen.setdefault((str(storage.device), storage.data_ptr()), storage)
        self._storages = list(seen.values())
        self._nbytes = [storage.nbytes() for storage in self._storages]
        self._parked: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes moved by one offload (0 when everything already lives in host memory)."""
        return sum(self._nbytes)

    @property
    def offloaded(self) -> bool:
        """Whether the storages are in host memory now."""
        return bool(self._parked)

    @torch.no_grad()
    def offload(self) -> None:
        """Copy every storage to host memory, then give its device memory back."""
        if self._parked or not self._storages:
            return
        pin = torch.cuda.is_available()
        for storage, nbytes in zip(self._storages, self._nbytes):
            parked = torch.empty(nbytes, dtype=torch.uint8, device=self.host, pin_memory=pin)
            parked.copy_(_bytes_of(storage), non_blocking=pin)
            self._parked.append(parked)
        if pin:
            torch.cuda.synchronize()  # the copies are done before the memory is freed
        for storage in self._storages:
            storage.resize_(0)

    @torch.no_grad()
    def onload(self) -> None:
        """Grow every storage back on its device and copy its bytes in."""
        if not self._parked:
            return
        for storage, nbytes, parked in zip(self._storages, self._nbytes, self._parked):
            storage.resize_(nbytes)
            _bytes_of(storage).copy_(parked, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies may be dropped (and their pages reused)
        self._parked = []


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TrainerOffload:
    """A rank's training state parked in host memory around generation (`rollout.placement: colocated`).

    Built once the optimizer exists (its state tensors are created lazily at its first step, so
    the set is taken again at each offload).
    """

    def __init__(self, ddp_model: torch.nn.Module, optimizer) -> None:
        self.model, self.optimizer = ddp_model, optimizer
        self._parked: ParkedStorages | None = None

    def offload(self) -> int:
        """Move the state to host memory; returns the bytes moved (0 on a CPU-only run)."""
        if self._parked is None:
            self._parked = ParkedStorages(trainer_state_tensors(self.model, self.optimizer))
            self._parked.offload()
        return self._parked.nbytes

    def onload(self) -> None:
        """Bring the state back to the compute device for training."""
        if self._parked is not None:
            self._parked.onload()
            self._parked = None
