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
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        host: torch.device = HOST,
        *,
        include_host: bool = False,
        leave: list[torch.Tensor] = (),
    ) -> None:
        self.host = host
        left = {_storage_key(t.untyped_storage()) for t in leave}
        seen: dict[tuple[str, int], torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if (
                (include_host or storage.device != host)
                and storage.nbytes()
                and _storage_key(storage) not in left
            ):
                seen.setdefault(_storage_key(storage), storage)
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

    def offload(self, *, keep_weights: bool = False) -> int:
        """Move the state to host memory; returns the bytes moved now (0 on a CPU-only run).

        Args:
            keep_weights: leave the parameters on the device (a later `offload()` moves them).
        """
        moved = 0
        weights = weight_tensors(self.model)
        if self._rest is None:
            state = trainer_state_tensors(self.model, self.optimizer)
            self._rest = ParkedStorages(state, include_host=self.include_host, leave=weights)
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
