"""The Hugging Face side of the policy: Qwen3-MoE checkpoints in, out and streamed.

- `config`: HF `config.json` <-> `MoEModelConfig`, and what it refuses;
- `checkpoint`: safetensors shards on disk (read, write, a tiny random checkpoint);
- `convert`: HF tensors <-> megatron-core shards at any TP x EP x PP layout, and the conversion check
  (`python -m megatron_gspo.model.hf.convert`);
- `stream`: the policy's weights as a stream of HF tensors cut into buckets (weight sync, export);
- `export`: the policy written as an HF checkpoint directory.
"""

from megatron_gspo.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Bucket": "stream",
        "ConversionError": "convert",
        "HFConfigError": "config",
        "export_hf_checkpoint": "export",
        "from_hf_config": "config",
        "iter_buckets": "stream",
        "iter_hf_tensors": "stream",
        "load_hf_checkpoint": "convert",
        "load_hf_state_dict": "checkpoint",
        "make_tiny_hf_checkpoint": "checkpoint",
        "read_hf_config": "config",
        "save_hf_state_dict": "checkpoint",
        "to_hf_config": "config",
    },
)
__all__ = __dir__()
