"""The disk method: a full HF checkpoint written atomically, then `/update_weights_from_disk`."""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.model import control_plane
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.weight_sync.session import SyncStats, WeightSyncFailed


class DiskMethod:
    """`WeightSync`'s disk method (state: `model`, `export_dir`, `model_cfg`, `tokenizer`)."""

    def _via_disk(self, client: SGLangClient | None, version: int) -> SyncStats:
        path = export_hf_checkpoint(self.model, self.export_dir, self.model_cfg, self.tokenizer)

        def load() -> SyncStats:
            client.update_weights_from_disk(str(path), weight_version=str(version))
            size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            return SyncStats(bytes=size, buckets=1, largest_bucket_bytes=size)

        try:
            return control_plane.on_rank0(load)
        except Exception as err:
            raise WeightSyncFailed(f"{type(err).__name__}: {err}") from err
