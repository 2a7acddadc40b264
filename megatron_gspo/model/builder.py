"""Build the Qwen3-MoE-shaped Megatron-Core `GPTModel` from an `MoEModelConfig`.

The mapping to `TransformerConfig` reproduces HF Qwen3-MoE numerically (RMSNorm eps from
the checkpoint, QK-norm, GQA, non-interleaved RoPE, SwiGLU experts, softmax router whose
top-k probabilities are renormalised when `norm_topk_prob`, top-1 included; RoPE with a
float base, or megatron's YaRN rotary embedding for `rope_type: yarn`). The vocabulary is padded
for TP as megatron pads it (`ParallelConfig.padded_vocab_size`); the built model records the real
size (`unpadded_vocab_size`) so the padded logits are masked wherever a softmax or an argmax is
taken. The layer spec is the TransformerEngine one when TE imports and CUDA is present,
Megatron's local spec otherwise; the rest is configuration, so CPU and H100 runs use the
same code. In bf16 the model is wrapped in megatron's `Float16Module` as megatron's own
training loop does (bf16 parameters and compute, fp32 outputs); the optimizer then keeps fp32
main parameters (`model/optim.py`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import ParallelConfig
from megatron_gspo.model.engine import EngineConfig, KernelAvailability, fused_flags, resolve_use_te


def transformer_config(
    model: MoEModelConfig,
    parallel: ParallelConfig,
    engine: EngineConfig | None = None,
    *,
    routing_replay: bool = False,
    aux_loss_coeff: float | None = None,
    available: KernelAvailability | None = None,
):
    """The megatron `TransformerConfig` of this architecture, layout and engine.

    Args:
        model: the architecture.
        parallel: the TP x PP x EP layout.
        engine: numerics and kernels (default `EngineConfig()`).
        routing_replay: build megatron's per-layer `RouterReplay` handles.
        aux_loss_coeff: load-balancing loss coefficient; None: the architecture's
            (`model.aux_loss_coeff`, the checkpoint's `router_aux_loss_coef`). RL passes its own.
        available: the machine's kernels (default: detected); decides the fused flags.
    """
    from megatron.core.transformer import TransformerConfig

    engine = engine or EngineConfig()
    available = available or KernelAvailability.detect()
    aux = model.aux_loss_coeff if aux_loss_coeff is None else aux_loss_coeff
    if aux < 0:
        raise ValueError(f"aux_loss_coeff must be >= 0, got {aux}")
    # Top-1 routing with norm_topk_prob: the one selected expert's weight is softmax over its
    # own logit, exactly 1, as in transformers (the router learns only from the aux loss).
    # Megatron refuses that combination up front (for the zero router gradient); it is
    # validated as pre-softmax and switched to what the checkpoint computes afterwards.
    top1_renormalised = model.moe_topk == 1 and model.norm_topk_prob
    recompute = {}
    if engine.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif engine.recompute == "selective":  # all layers, these parts only (no method / layer count)
        recompute = dict(recompute_granularity="selective", recompute_modules=engine.selective_modules)
    flags = fused_flags(engine, available)
    if model.rope_type == "yarn":
        flags["apply_rope_fusion"] = False  # TE's fused RoPE refuses YaRN's mscale != 1
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=4 * model.moe_ffn_hidden_size,  # dense FFN width; unused (all layers MoE)
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_layer_freq=1,
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the top-k logits == softmax over all, top-k, renormalise.
        moe_router_pre_softmax=top1_renormalised or not model.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_token_dispatcher_type=parallel.token_dispatcher,
        moe_enable_routing_replay=routing_replay,
        **flags,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        account_for_embedding_in_pipeline_split=parallel.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallel.account_for_loss_in_pipeline_split,
        # Packed micro-batches differ in length: stages exchange shapes before activations.
        variable_seq_lengths=parallel.pipeline_parallel > 1,
        # The interleaved schedule sends both ways in one call; batched, the two messages to the
        # one neighbour of a 2-stage ring cross (megatron-LM turns batching off for it too).
        batch_p2p_comm=parallel.virtual_pipeline is None,
        pipeline_dtype=engine.torch_dtype,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.use_sequence_parallel,
        use_cpu_initialization=not available.cuda,
        params_dtype=engine.torch_dtype,
        bf16=engine.dtype == "bf16",
        fp16=False,
        **recompute,
    )
    if top1_renormalised:
        config.moe_router_pre_softmax = False
    if model.rope_type == "yarn":
        # GPTModel(position_embedding_type="yarn") and attention read these as attributes of
        # the config (megatron's training arguments set them the same way).
        yarn_mscale = model.yarn_mscale and model.yarn_mscale_all_dim  # transformers: both or neither
        for name, value in {
            "yarn_rotary_scaling_factor": model.yarn_factor_resolved,
            "yarn_original_max_position_embeddings": model.yarn_original_max_positions,
            "yarn_beta_fast": model.yarn_beta_fast or 32.0,
            "yarn_beta_slow": model.yarn_beta_slow or 1.0,
            "yarn_mscale": model.yarn_mscale if yarn_mscale else None,
            "yarn_mscale_all_dim": model.yarn_mscale_all_dim if yarn_mscale else None,
            "yarn_correction_range_round_to_int": model.yarn_truncate is not False,
        }.items():
            setattr(config, name, value)
    return config


def layer_spec(model: MoEModelConfig, engine: EngineConfig, available: KernelAvailability | None = None):
    """Megatron layer spec: TransformerEngine on GPU nodes with TE, the local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    available = available or KernelAvailability.detect()
    if resolve_use_te(engine, available):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts,
            moe_grouped_gemm=fused_flags(engine, available)["moe_grouped_gemm"],
            qk_layernorm=True,
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )


def build_model(
    model: MoEModelConfig,
    parallel: ParallelConfig,
    engine: EngineConfig | None = None,
    *,
    routing_replay: bool = False,
    aux_loss_coeff: float | None = None,
):
    """Build this rank's shard of the policy (call after `init_distributed`).

    Under pipeline parallelism the shard is this rank's stage: the embedding only on the first
    stage, the output layer only on the last, and megatron numbers the stage's layers globally.

    In bf16 the result is megatron's `Float16Module` around the `GPTModel` (as megatron's
    `get_model` wraps it); code that needs the `GPTModel` unwraps `.module`. With
    `parallel.virtual_pipeline` it is a `ModelChunks` of one such module per chunk
    (`model/chunks.py`; `model_chunks` lists them).

    Megatron's RouterReplay keeps a class-level list of per-layer instances; it is cleared
    here so a second model built in one process never inherits the first one's layers.
    `aux_loss_coeff` as in `transformer_config`.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    engine = engine or EngineConfig()
    available = KernelAvailability.detect()
    engine.check_hardware(available)
    parallel.check_num_layers(model.num_layers)
    if routing_replay and engine.router_fusion:
        raise ValueError("routing replay with engine.router_fusion: the fused top-k silently bypasses replay")
    if parallel.context_parallel > 1 and not resolve_use_te(engine, available):
        raise ValueError(
            f"parallel.context_parallel={parallel.context_parallel} needs the TransformerEngine spec "
            "(engine.use_te, CUDA + transformer_engine): megatron's local attention cannot attend across "
            "context-parallel ranks; set parallel.context_parallel=1"
        )
    RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(
        model,
        parallel,
        engine,
        routing_replay=routing_replay,
        aux_loss_coeff=aux_loss_coeff,
        available=available,
    )
    spec = layer_spec(model, engine, available)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    chunk_layers = parallel.chunk_layers(model.num_layers)[stage]
    chunks = [
        _build_chunk(model, parallel, config, spec, c if parallel.virtual_pipeline else None, first, layers)
        for c, (first, layers) in enumerate(chunk_layers)
    ]
    if parallel.virtual_pipeline:
        from megatron_gspo.model.chunks import ModelChunks

        return ModelChunks(chunks)
    return chunks[0]


def _build_chunk(
    model: MoEModelConfig, parallel: ParallelConfig, config, spec, vp_stage, first: int, layers: int
):
    """One `GPTModel`: a whole stage, or chunk `vp_stage` of it (`layers` from `first`); bf16-wrapped."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    ends = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=parallel.padded_vocab_size(model.vocab_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(**ends),
        post_process=parallel_state.is_pipeline_last_stage(**ends),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="yarn" if model.rope_type == "yarn" else "rope",
        rotary_percent=1.0,
        rotary_base=model.rope_theta,
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    built = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    if built != list(range(first, first + layers)):  # a megatron that splits otherwise: misnamed layers
        raise RuntimeError(
            f"megatron built layers {built} on this pipeline stage / chunk, the layout says "
            f"{layers} from layer {first}"
        )
    # Rows past the vocabulary are megatron's TP padding: masked in every softmax
    # (`unpadded_vocab_size`), dropped on export and weight sync.
    gpt.unpadded_vocab_size = model.vocab_size
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, gpt)
    return gpt


def unpadded_vocab_size(model: torch.nn.Module) -> int:
    """The real vocabulary of a built policy (megatron's `vocab_size` includes the TP padding)."""
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    return getattr(model, "unpadded_vocab_size", model.vocab_size)


def model_config_dict(model: MoEModelConfig) -> dict:
    """Plain dict of the architecture (for checkpoints and logs)."""
    return dataclasses.asdict(model)
