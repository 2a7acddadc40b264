"""How the trainer's weights get to the rollout servers after every step.

- `sync`: `WeightSync`, one sync with its retries, whatever the method;
- `update_group`: the weight-update process group the trainer's sender and the servers join
  (the distributed method; SGLang's `/init_weights_update_group`);
- `tensor_handles`: SGLang's `/update_weights_from_tensor` payload, handles to the bucket's memory
  (the tensor method);
- `shm_exports`: RAM-backed HF exports for `/update_weights_from_disk` (the disk method).

The embedded server receives with the same `update_group` and `tensor_handles`, as SGLang does.
"""

from megatron_gspo.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "SyncStats": "sync",
        "WeightSync": "sync",
        "WeightSyncFailed": "sync",
    },
)
__all__ = __dir__()
