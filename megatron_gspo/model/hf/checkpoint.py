"""HF Qwen3-MoE checkpoints on disk: build a tiny random one, read and write safetensors shards.

On-disk layout (what transformers 5.x `save_pretrained` writes and `from_pretrained` reads,
and what SGLang and the Megatron converter consume): per-expert names
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`. In memory transformers 5.x
holds the experts fused as 3-D tensors `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
first) and `mlp.experts.down_proj` [E, H, I]; `module_state_to_hf` converts the in-memory
state dict to the on-disk names, `hf_to_module_state` back.

Writes are atomic: shards, index and config go to a temporary sibling directory that is
renamed into place, so a reader (the rollout server) never sees a half-written checkpoint.

    python -m megatron_gspo.model.hf.checkpoint --out DIR [--preset tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen3MoeConfig

from megatron_gspo.checksums import file_checksum
from megatron_gspo.model.config import MoEModelConfig, preset
from megatron_gspo.model.hf.config import to_hf_config
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$"
)


def module_state_to_hf(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory transformers 5.x state dict -> on-disk HF names (experts split per expert).

    Args:
        state_dict: `Qwen3MoeForCausalLM.state_dict()`; fused experts `...mlp.experts.gate_up_proj`
            [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I]; other names pass through.

    Returns:
        Names as `save_pretrained` writes them: `...mlp.experts.{e}.gate_proj.weight` [I, H],
        `up_proj.weight` [I, H], `down_proj.weight` [H, I].
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match["prefix"], match["kind"]
        for e in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                gate, up = tensor[e].chunk(2, dim=0)  # HF computes `gate, up = linear(x, W).chunk(2)`
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
    return out


def hf_to_module_state(hf_state: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """On-disk HF names -> in-memory transformers 5.x names (experts fused); inverse of `module_state_to_hf`.

    Every layer's experts must be complete (all E experts with gate, up and down); a partial
    expert set is an error naming the missing tensor (use `copy_into_model` for partial updates).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match["prefix"], {})[(int(match["e"]), match["kind"])] = tensor
    for prefix, parts in experts.items():
        for e in range(num_experts):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if (e, kind) not in parts:
                    raise KeyError(
                        f"checkpoint lacks {prefix}.{e}.{kind}.weight (expected {num_experts} experts)"
                    )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(num_experts)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    return out


def _target(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """The slice of `params` an on-disk (or in-memory) HF tensor name lands in."""
    match = _PER_EXPERT.match(name)
    if match is None:
        target = params.get(name)
        if target is None:
            raise KeyError(f"model has no parameter named {name}")
        return target
    kind, e = match["kind"], int(match["e"])
    fused = params.get(f"{match['prefix']}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
    if fused is None or e >= fused.shape[0]:
        raise KeyError(f"model has no parameter for {name}")
    target = fused[e]
    if kind != "down_proj":
        half = target.shape[0] // 2
        target = target[:half] if kind == "gate_proj" else target[half:]
    return target


def _targets(
    model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    pairs = []
    for name, tensor in hf_state.items():
        target = _target(params, name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        pairs.append((target, tensor))
    return pairs


def check_fits_model(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Raise (naming the tensor) unless `copy_into_model(model, hf_state)` would succeed."""
    _targets(model, hf_state)


@torch.no_grad()
def copy_into_model(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor]) -> int:
    """Copy tensors with on-disk (or in-memory) HF names into `model`'s parameters in place.

    Partial updates are allowed: a single expert's `gate_proj` lands in its rows of the fused
    `gate_up_proj`. Unknown names and shape mismatches raise, naming the tensor, before
    anything is copied.

    Returns:
        Number of tensors copied.
    """
    pairs = _targets(model, hf_state)
    for target, tensor in pairs:
        target.copy_(tensor.to(dtype=target.dtype, device=target.device))
    return len(pairs)


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on `tensor`'s device: no NaN/inf in it.

    From the min and max (NaN propagates through both, an inf is one of them), so no
    tensor-sized temporary is made: `isfinite(t).all()` would allocate about 1.5x the tensor.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor.detach())
    return torch.isfinite(low) & torch.isfinite(high)


def non_finite(name: str, tensor: torch.Tensor) -> str | None:
    """What is wrong if `tensor` holds NaN or inf, else None.

    One reduction on the device the tensor is on (no copy); counting only for a bad tensor.
    """
    if bool(finite_flag(tensor)):
        return None
    count = int((~torch.isfinite(tensor)).sum())
    return f"tensor {name} has {count} non-finite value(s) (NaN/inf) among {tensor.numel()}"


def first_non_finite(named_tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor of `named_tensors` that holds NaN or inf, else None.

    One foreach norm per device first: a NaN/inf makes a tensor's norm NaN/inf, and a finite
    norm clears it (0.1 ms for a weight sync's ~70 small tensors). Only a device whose norms
    are not all finite, which a huge finite tensor's overflowing norm can also cause, gets the
    exact pass: one flag per tensor, read back once per device.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors.items():
        if tensor.is_floating_point() and tensor.numel():
            by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    bad = set()
    for entries in by_device.values():
        if bool(torch.isfinite(torch.stack(torch._foreach_norm([t for _, t in entries]))).all()):
            continue
        finite = torch.stack([finite_flag(t) for _, t in entries]).cpu().tolist()
        bad.update(name for (name, _), ok in zip(entries, finite) if not ok)
    return next((name for name in named_tensors if name in bad), None)


def check_finite(named_tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise ValueError naming the first tensor of `named_tensors` that holds NaN or inf."""
    name = first_non_finite(named_tensors)
    if name is not None:
        raise ValueError(f"{where}: {non_finite(name, named_tensors[name])}")


def _shard_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / SAFE_WEIGHTS_INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [ckpt_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    return files


def load_hf_state_dict(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (every safetensors shard), with on-disk names.

    Raises:
        FileNotFoundError: the directory or its shards do not exist.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(ckpt_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                state[name] = f.get_tensor(name)
    return state


class HFCheckpointWriter:
    """Writes an HF checkpoint directory shard by shard, then publishes it atomically.

    `add` tensors in any order: a safetensors shard is written (and dropped from memory) as
    soon as `max_shard_bytes` have accumulated, so the writer holds at most one shard, never
    the whole model. `finish` names the shards as HF does (`model.safetensors` alone, else
    `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`), writes config.json
    (and the tokenizer), fsyncs and renames the temp dir onto `ckpt_dir`; `abort` (or an
    exception inside a `with` block) deletes the temp dir and leaves `ckpt_dir` as it was.
    With tied embeddings `lm_head.weight` is dropped (HF re-ties it on load).
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        model_cfg: MoEModelConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        checksums: bool = False,
    ):
        if tokenizer is not None and len(tokenizer) > model_cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens > model vocab_size={model_cfg.vocab_size}"
            )
        self.ckpt_dir = Path(ckpt_dir)
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.checksums = checksums
        self.ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.ckpt_dir.name}.tmp-", dir=self.ckpt_dir.parent))
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []  # written shards and their tensor names
        self.total_bytes = 0
        self.largest_shard_bytes = 0
        self._dtypes: set[torch.dtype] = set()

    def __enter__(self) -> HFCheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (on-disk HF name); copied to host memory now."""
        if self.model_cfg.tie_word_embeddings and name == "lm_head.weight":
            return
        if name in self._shard or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} added twice")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[name] = tensor
        self._shard_bytes += nbytes
        self.total_bytes += nbytes
        if tensor.is_floating_point():
            self._dtypes.add(tensor.dtype)

    def _flush(self) -> None:
        path = self.tmp / f"shard-{len(self._files):05d}.safetensors"
        save_file(self._shard, str(path), metadata={"format": "pt"})
        self._files.append((path, sorted(self._shard)))
        self.largest_shard_bytes = max(self.largest_shard_bytes, self._shard_bytes)
        self._shard, self._shard_bytes = {}, 0

    def finish(self) -> Path:
        """Write the last shard, the index and config.json; publish the directory atomically."""
        try:
            if self._shard or not self._files:
                self._flush()
            self._name_shards()
            self._write_config()
            _write_export_marker(self.tmp, checksums=self.checksums)
            for f in self.tmp.iterdir():  # make the data durable before the rename publishes it
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.chmod(self.tmp, 0o755)
            _replace_dir(self.tmp, self.ckpt_dir, overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        return self.ckpt_dir

    def abort(self) -> None:
        """Delete the temp dir; `ckpt_dir` is left as it was."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _name_shards(self) -> None:
        if len(self._files) == 1:
            os.replace(self._files[0][0], self.tmp / SAFE_WEIGHTS_NAME)
            return
        weight_map = {}
        n = len(self._files)
        for k, (path, names) in enumerate(self._files, start=1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.tmp / fname)
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2))

    def _write_config(self) -> None:
        hf_cfg = to_hf_config(self.model_cfg)
        if len(self._dtypes) == 1:
            hf_cfg["dtype"] = str(next(iter(self._dtypes))).removeprefix("torch.")
        tokenizer = self.tokenizer
        if tokenizer is not None:
            ids = {
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            }
            hf_cfg.update(ids)
            tokenizer.save_pretrained(str(self.tmp))
            GenerationConfig(**ids).save_pretrained(str(self.tmp))
        (self.tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True))


def save_hf_state_dict(
    ckpt_dir: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    model_cfg: MoEModelConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a whole state dict (on-disk HF names) as an HF checkpoint directory, atomically.

    `module_state_to_hf` converts a module's state; see `HFCheckpointWriter` for the layout.
    Tensors go into shards in name order.
    """
    with HFCheckpointWriter(
        ckpt_dir, model_cfg, tokenizer, max_shard_bytes=max_shard_bytes, overwrite=overwrite
    ) as writer:
        for name in sorted(state_dict):
            writer.add(name, state_dict[name])
        return writer.finish()


# Every name an HF checkpoint export writes: weights, index, configs and tokenizer files.
_EXPORT_FILE = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors"
    r"|model\.safetensors\.index\.json|tokenizer(_config)?\.json|tokenizer\.model"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json))$"
)


EXPORT_MARKER = "megatron_gspo_export.json"
"""Written into every export (last, listing the export's files): what makes a directory an
earlier export that the next one may replace. An HF model saved by another tool has the same
file names, so names alone cannot tell a user's base model from an export."""


class ExportTargetError(ValueError):
    """An export's target directory holds something an export did not write: it is not replaced."""


def _write_export_marker(directory: Path, *, checksums: bool = False) -> None:
    """List the export's files (and, asked for, their SHA-256: an export kept to be read back)."""
    files = sorted(p.name for p in directory.iterdir())
    marker: dict = {"written_by": "megatron-gspo", "files": files}
    if checksums:
        marker["sha256"] = {name: file_checksum(directory / name) for name in files}
    (directory / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")


class ExportDamagedError(ValueError):
    """A checksummed export whose files are missing or differ from what was written (named)."""


def verify_export(path: str | os.PathLike) -> bool:
    """Check a checksummed export's files; False when it carries no checksums (written without).

    Raises:
        ExportDamagedError: naming the first file that is missing or whose bytes changed.
    """
    path = Path(path)
    try:
        expected = json.loads((path / EXPORT_MARKER).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError) as err:
        raise ExportDamagedError(f"{path}: unreadable {EXPORT_MARKER} ({err})") from None
    if expected is None:
        return False
    for name, digest in sorted(expected.items()):
        if not (path / name).is_file():
            raise ExportDamagedError(f"{path / name} is missing")
        if file_checksum(path / name) != digest:
            raise ExportDamagedError(f"{path / name} differs from what was written (SHA-256 mismatch)")
    return True


def _written_by_an_export(path: Path, names: set[str]) -> bool:
    """`path` holds an export marker that lists every file there."""
    try:
        marker = json.loads((path / EXPORT_MARKER).read_text())
        return marker.get("written_by") == "megatron-gspo" and names - {EXPORT_MARKER} <= set(marker["files"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def check_export_target(path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Refuse a target that is neither absent, empty, nor an earlier export of this project.

    An export replaces its target whole, so anything else in it (a run directory's checkpoints
    and metrics, a user's files, an HF model another tool saved) would be deleted. With
    `overwrite`, an HF model directory (HF file names only) is replaced too; anything else never.

    Raises:
        ExportTargetError: naming what the directory holds that an export does not write.
    """
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ExportTargetError(f"{path} exists and is not a directory; give a new or empty directory")
    entries = list(path.iterdir())
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in entries if not (
        p.is_file() and not p.is_symlink() and _EXPORT_FILE.match(p.name)
    ))  # fmt: skip
    foreign = [name for name in foreign if name != EXPORT_MARKER]
    if foreign or (entries and not (path / "config.json").is_file()):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExportTargetError(
            f"{path} is not an earlier HF export (it holds {shown or 'no config.json'}); an export "
            "replaces its whole directory, so it refuses this one: give a new or empty directory"
        )
    if entries and not overwrite and not _written_by_an_export(path, {p.name for p in entries}):
        raise ExportTargetError(
            f"{path} holds an HF model that megatron-gspo did not write (no {EXPORT_MARKER} listing its "
            "files); an export replaces its whole directory: give a new or empty directory, or pass "
            "--overwrite to replace that model"
        )


def _replace_dir(src: Path, dst: Path, *, overwrite: bool = False) -> None:
    """Rename `src` to `dst`; an earlier export at `dst` is moved aside first and deleted after.

    Raises:
        ExportTargetError: `dst` holds anything but an earlier export (nothing is touched).
    """
    check_export_target(dst, overwrite=overwrite)
    if not dst.exists() or not any(dst.iterdir()):
        os.replace(src, dst)  # an empty directory is replaced by the rename itself
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def build_hf_model(model_cfg: MoEModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised HF `Qwen3MoeForCausalLM` (init std `model_cfg.init_std`), in eval mode."""
    from transformers import Qwen3MoeForCausalLM  # its modeling imports cost every rank ~0.4 s

    hf_config = Qwen3MoeConfig(**to_hf_config(model_cfg))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(hf_config)
    return model.to(dtype).eval()


def make_tiny_hf_checkpoint(
    out_dir: str | os.PathLike,
    model_cfg: MoEModelConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a random HF Qwen3-MoE from `model_cfg` and save it with tokenizer and generation config.

    Args:
        out_dir: Checkpoint directory (replaced atomically if it exists).
        model_cfg: Architecture; `vocab_size` must cover the tokenizer.
        tokenizer: Defaults to the project's character tokenizer (`build_char_tokenizer()`).
        seed: Seed of the weight init (same seed -> identical weights).
        dtype: Parameter dtype written to disk.

    Returns:
        The checkpoint directory, loadable with `AutoModelForCausalLM.from_pretrained`.
    """
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    if len(tokenizer) > model_cfg.vocab_size:
        raise ValueError(
            f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)"
        )
    model = build_hf_model(model_cfg, seed=seed, dtype=dtype)
    return save_hf_state_dict(out_dir, module_state_to_hf(model.state_dict()), model_cfg, tokenizer)


def main(argv: list[str] | None = None) -> int:
    """Command line: write a random HF checkpoint of a preset architecture with the char tokenizer."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to (re)create")
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed")
    parser.add_argument("--init-std", type=float, default=None, help="override the preset's init std")
    args = parser.parse_args(argv)
    tokenizer = build_char_tokenizer()
    changes = {"vocab_size": len(tokenizer)}
    if args.init_std is not None:
        changes["init_std"] = args.init_std
    model_cfg = preset(args.preset, **changes)
    path = make_tiny_hf_checkpoint(args.out, model_cfg, tokenizer, seed=args.seed)
    print(f"wrote {path} ({model_cfg.num_parameters} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
