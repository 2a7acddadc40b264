"""Before the models exist: the run's tokenizer and where its exported weights go."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megatron_gspo.config import ConfigError, RunConfig


def load_tokenizer(cfg: RunConfig):
    """The checkpoint's tokenizer (`model.hf_path`), else the character tokenizer of the demo tasks."""
    if cfg.model.hf_path:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(cfg.model.hf_path)
        except (OSError, ValueError) as err:  # no tokenizer files, or ones transformers cannot read
            message = " ".join(str(err).split())[:300]
            raise ConfigError(
                f"model.hf_path={cfg.model.hf_path}: cannot load its tokenizer: {message}"
            ) from None
    from megatron_gspo.tasks.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def weight_sync_dir(cfg: RunConfig) -> Path:
    """Where exported weights go: the configured dir, else RAM-backed /dev/shm, else the run dir."""
    if cfg.trainer.weight_sync_dir:
        return Path(cfg.trainer.weight_sync_dir)
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        tag = hashlib.blake2b(str(Path(cfg.trainer.run_dir).resolve()).encode(), digest_size=6).hexdigest()
        return Path("/dev/shm", f"megatron-gspo-{tag}", "policy")
    return Path(cfg.trainer.run_dir, "weights", "policy")
