"""Whether real SGLang can serve the trainer's blockwise FP8 weights: its checkpoint and layout.

`rollout.quantization: fp8` sends each decoder projection as FP8 plus a per-128x128-block
`weight_scale_inv` (`model/fp8/blockwise.py`). What SGLang 0.5.23 does with that, and so what is refused
here, by name, before a server or a rank starts:

- A checkpoint without a block `quantization_config` in its config.json, served with
  `--quantization fp8`: `get_quant_config` (model_loader/weight_utils.py) finds none and
  returns `Fp8Config()` (`is_checkpoint_fp8_serialized=False`, `weight_block_size=None`), i.e.
  online per-tensor FP8. `Fp8LinearMethod` / `Fp8MoEMethod.create_weights` then register no
  `weight_scale_inv` (only a serialized block checkpoint gets them), and the models'
  `load_weights` skip names they lack (`if name not in params_dict: continue`): the trainer's
  block scales are dropped and the unscaled FP8 values are served. The server starts and
  serves wrong weights, silently.
- A block-FP8 checkpoint whose experts, split over the server's ranks, are not whole blocks:
  SGLang gives each rank `moe_intermediate_size / moe_tp_size` of every expert it holds, where
  `moe_tp_size = tp_size / ep_size` (`--tp-size`, `--ep-size`; also / `--moe-dp-size`, 1 unless
  given), and `check_quantized_moe_compatibility` (model_executor/model_runner_components/
  moe_ep_setup.py; again `Fp8MoEMethod.create_fp8_moe_weight_`) refuses to start unless that
  width is a multiple of block_n = 128. Qwen3-30B-A3B (768) at TP 4, EP 1 gives 192; 235B-A22B
  (1536) at TP 8, EP 1 gives 192. EP = TP gives whole experts per rank (768, 1536).
- A block-FP8 checkpoint that keeps some projections unquantised (`quantization_config`'s
  `ignored_layers`, else `modules_to_not_convert`: `Fp8Config.from_config`, layers/quantization/
  fp8.py): SGLang gives those modules `UnquantizedLinearMethod`, a bf16 weight and no
  `weight_scale_inv`, while the trainer sends every decoder projection as FP8 and its scales; the
  loader copies the raw FP8 values into the bf16 weight and drops the scale. An entry naming a
  projection (`..._proj`) or a module holding some (a layer, its `self_attn`, `mlp`, `experts`)
  is refused; the router gates, norms, embeddings and `lm_head` the trainer never quantises.

Torch-free, so `launch/sglang_servers.sh` runs it (`python -m megatron_gspo.model.fp8.serving
MODEL TP EP`) before it starts SGLang; `config.validate` runs it for real SGLang servers
(`rollout.server_urls` / `rollout.router_url`). The embedded CPU server is not SGLang: it
dequantises whatever it receives, at any width.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BLOCK = 128
"""Block edge of the Qwen3-*-FP8 checkpoints' `weight_block_size: [128, 128]`."""


class Fp8ServingError(ValueError):
    """SGLang cannot serve the trainer's block-FP8 weights from this checkpoint and layout."""


def _hf_config(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise Fp8ServingError(
            f"rollout.quantization=fp8: cannot read the rollout checkpoint's {path} ({err.strerror or err}); "
            "FP8 rollouts need it to be a block-FP8 checkpoint"
        ) from None


def _whole_blocks(width: int, moe_tp: int) -> bool:
    """Whether `moe_tp` ranks each get a multiple of BLOCK of an expert `width` wide."""
    return width % moe_tp == 0 and (width // moe_tp) % BLOCK == 0


_HOLDS_PROJECTIONS = {"model", "layers", "self_attn", "mlp", "experts", "shared_expert", "shared_experts"}
"""Module names on the path to a decoder projection: an ignored entry made of these (and layer or
expert indices) covers projections the trainer quantises."""


def covers_a_quantised_projection(entry: str) -> bool:
    """Whether an ignored-layers entry leaves unquantised a projection the trainer sends as FP8."""
    parts = [p for p in entry.removesuffix(".weight").split(".") if p]
    if not parts:
        return False
    if parts[-1].endswith("_proj"):  # q/k/v/o, gate/up/down, fused qkv / gate_up
        return True
    return all(p in _HOLDS_PROJECTIONS or p.isdigit() for p in parts)


def check_fp8_serving(checkpoint: str | Path, tp: int, ep: int) -> None:
    """Raise `Fp8ServingError` unless SGLang at --tp-size `tp`, --ep-size `ep` can serve block FP8.

    The checkpoint's config.json must carry `quantization_config: {quant_method: fp8,
    weight_block_size: [128, 128]}` and each rank's expert width (moe_intermediate_size /
    (tp / ep)) must be a multiple of 128.
    """
    cfg = _hf_config(checkpoint)
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise Fp8ServingError(
            f"rollout.quantization=fp8: the rollout checkpoint {checkpoint} is not block FP8 (its "
            f"config.json has quantization_config={quant or None}, needs quant_method: fp8 and "
            f"weight_block_size: [{BLOCK}, {BLOCK}]); SGLang would serve it with online per-tensor "
            "FP8, which has no weight_scale_inv parameters, and drop the block scales the trainer "
            "sends. Launch the servers from a block-FP8 checkpoint of the same model (e.g. "
            "Qwen3-30B-A3B-FP8; the trainer's first sync replaces its weights) or set "
            "rollout.quantization=none"
        )
    key = "ignored_layers" if quant.get("ignored_layers") else "modules_to_not_convert"
    kept = [str(e) for e in quant.get(key) or [] if covers_a_quantised_projection(str(e))]
    if kept:
        raise Fp8ServingError(
            f"rollout.quantization=fp8: the rollout checkpoint {checkpoint} keeps {kept} unquantised "
            f"(quantization_config.{key}); SGLang loads those as bf16 weights without "
            "weight_scale_inv, so the trainer's FP8 values would be cast in unscaled and their scales "
            "dropped. Use a checkpoint that quantises every decoder projection (e.g. Qwen3-30B-A3B-FP8) "
            "or set rollout.quantization=none"
        )
    if tp < 1 or ep < 1 or tp % ep:
        raise Fp8ServingError(f"rollout server layout TP={tp}, EP={ep}: SGLang needs EP to divide TP")
    width = cfg.get("moe_intermediate_size")
    if width is None:  # no routed experts: SGLang checks nothing more here
        return
    moe_tp = tp // ep
    if not _whole_blocks(width, moe_tp):
        fits = [e for e in range(1, tp + 1) if tp % e == 0 and _whole_blocks(width, tp // e)]
        raise Fp8ServingError(
            f"rollout.quantization=fp8: SGLang's block-FP8 MoE needs each rank's expert width to be a "
            f"multiple of {BLOCK}, and {checkpoint} (moe_intermediate_size {width}) at TP={tp}, EP={ep} "
            f"(expert TP {moe_tp} = TP / EP) gives {width / moe_tp:g}; the server would refuse to "
            f"start. Use EP in {fits} at TP={tp} (EP={tp}: whole experts per rank)"
            if fits
            else f"rollout.quantization=fp8: SGLang's block-FP8 MoE needs each rank's expert width to be a "
            f"multiple of {BLOCK}; {checkpoint} (moe_intermediate_size {width}) has none at TP={tp}"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_gspo.model.fp8.serving CHECKPOINT TP EP`: exit 1 with the reason, or 0."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m megatron_gspo.model.fp8.serving CHECKPOINT TP EP", file=sys.stderr)
        return 2
    try:
        check_fp8_serving(args[0], int(args[1]), int(args[2]))
    except (Fp8ServingError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
