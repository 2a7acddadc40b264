"""Analysis behind `tools/` and `megatron-gspo drift`: expert-activation drift and log-prob mismatch."""
