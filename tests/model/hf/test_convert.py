import json

import pytest
import torch
from convert_worker import VOCAB, make_checkpoint
from transformers import AutoModelForCausalLM

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.hf.checkpoint import (
    build_hf_model,
    load_hf_state_dict,
    make_tiny_hf_checkpoint,
    module_state_to_hf,
    save_hf_state_dict,
)
from megatron_gspo.model.hf.convert import (
    ConversionError,
    fuse_qkv,
    hf_to_megatron,
    hf_token_logprobs,
    load_hf_checkpoint,
    logprob_diff,
    main,
    megatron_to_hf,
    name_table,
    random_tokens,
    split_qkv,
)
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.sharding import gather_global_state_dict, load_global_state_dict

TOLERANCE = 1e-4
VARIANTS = {
    "renorm_untied": tiny(vocab_size=VOCAB),
    "no_renorm_untied": tiny(vocab_size=VOCAB, norm_topk_prob=False),
    "renorm_tied": tiny(vocab_size=VOCAB, tie_word_embeddings=True),
    "no_renorm_tied_sharp": tiny(
        vocab_size=VOCAB, norm_topk_prob=False, tie_word_embeddings=True, init_std=0.2
    ),
    "renorm_untied_sharp": tiny(vocab_size=VOCAB, init_std=0.2),
}


@pytest.fixture
def world_of_one():
    init_distributed(ParallelConfig(), seed=11)
    yield


def _hf_state(cfg, seed=0):
    state = module_state_to_hf(build_hf_model(cfg, seed=seed).state_dict())
    if cfg.tie_word_embeddings:  # on disk a tied lm_head is not stored (save_pretrained drops it)
        del state["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    return {
        k: 1.0 + 0.3 * torch.randn(v.shape, generator=gen) if "norm" in k else v for k, v in state.items()
    }


# ----------------------------------------------------------------------------- pure conversion


@pytest.mark.parametrize(
    "variant", ["renorm_untied", "no_renorm_untied", "renorm_tied", "no_renorm_tied_sharp"]
)
def test_round_trip_hf_megatron_hf_is_bit_exact(variant):
    cfg = VARIANTS[variant]
    hf = _hf_state(cfg)
    assert ("lm_head.weight" in hf) != cfg.tie_word_embeddings
    back = megatron_to_hf(hf_to_megatron(hf, cfg), cfg)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_fusion_matches_hand_built_per_group_layout():
    # 4 query heads in 2 groups, head_dim 2, hidden 3: each row is filled with a distinct label.
    d, hidden = 2, 3
    rows = {f"q{h}": [10 + h] * d for h in range(4)} | {f"k{g}": [20 + g] * d for g in range(2)}
    rows |= {f"v{g}": [30 + g] * d for g in range(2)}

    def block(*names):
        return torch.tensor([x for n in names for x in rows[n]], dtype=torch.float32)[:, None].expand(
            -1, hidden
        )

    q, k, v = block("q0", "q1", "q2", "q3"), block("k0", "k1"), block("v0", "v1")
    fused = fuse_qkv(q, k, v, head_dim=d)
    expected = block("q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1")  # [q of g; k_g; v_g] per group
    assert torch.equal(fused, expected)
    cfg = tiny(num_attention_heads=4, num_query_groups=2, head_dim=d, hidden_size=hidden)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))
    # A TP shard of the fused tensor (first half of the rows) is the fusion of the first group only.
    assert torch.equal(fused[: fused.shape[0] // 2], fuse_qkv(q[: 2 * d], k[:d], v[:d], head_dim=d))


def test_fc1_is_transformers_in_memory_gate_up_proj():
    cfg = VARIANTS["renorm_untied"]
    hf_model = build_hf_model(cfg, seed=2)
    mega = hf_to_megatron(module_state_to_hf(hf_model.state_dict()), cfg)
    experts = hf_model.model.layers[1].mlp.experts
    for e in range(cfg.num_experts):
        prefix = f"decoder.layers.1.mlp.experts.local_experts.{e}."
        assert torch.equal(mega[prefix + "linear_fc1.weight"], experts.gate_up_proj[e])
        assert torch.equal(mega[prefix + "linear_fc2.weight"], experts.down_proj[e])


def test_bad_state_dicts_name_the_tensor():
    cfg = VARIANTS["renorm_untied"]
    hf = _hf_state(cfg)
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.experts.7.up_proj.weight"}
    with pytest.raises(ConversionError, match=r"lacks 1 tensor.*experts\.7\.up_proj"):
        hf_to_megatron(missing, cfg)
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.input_layernorm"):
        hf_to_megatron(hf | {"model.layers.2.input_layernorm.weight": torch.ones(64)}, cfg)
    with pytest.raises(ConversionError, match=r"tie_word_embeddings"):
        hf_to_megatron(hf, cfg.replace(tie_word_embeddings=True))
    bad = hf | {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(
        ConversionError, match=r"layers\.0\.self_attn\.k_proj\.weight: shape \(16, 64\), expected \(32, 64\)"
    ):
        hf_to_megatron(bad, cfg)
    mega = hf_to_megatron(hf, cfg)
    with pytest.raises(ConversionError, match=r"lacks 1 tensor.*output_layer"):
        megatron_to_hf({k: v for k, v in mega.items() if k != "output_layer.weight"}, cfg)
    with pytest.raises(ConversionError, match=r"linear_qkv\.weight: shape \(64, 64\), expected \(128, 64\)"):
        megatron_to_hf(mega | {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(64, 64)}, cfg)


# ----------------------------------------------------------------------------- against the built model


def _hf_reference(path):
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return lambda tokens: hf_token_logprobs(hf_model, tokens)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loaded_model_matches_transformers_logprobs(world_of_one, tmp_path, variant):
    cfg = VARIANTS[variant]
    path = make_checkpoint(tmp_path / variant, cfg, seed=5)
    model = build_model(cfg, ParallelConfig()).eval()
    stats = load_hf_checkpoint(model, path, cfg)
    # The lazy per-tensor import lands exactly the global state dict of the whole-checkpoint conversion.
    hf = load_hf_state_dict(path)
    expected = hf_to_megatron(hf, cfg)
    loaded = gather_global_state_dict(model)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)
    assert stats.tensors == len(expected)
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in hf.values())
    worst, mean = logprob_diff(model, _hf_reference(path), random_tokens(cfg.vocab_size, 4, 48, seed=1))
    print(f"{variant}: per-token |dlogprob| max={worst:.3e} mean={mean:.3e}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    "wrong",
    ["qkv_concatenated", "gate_up_swapped", "q_k_norms_swapped"],
)
def test_wrong_mapping_is_detected(world_of_one, tmp_path, wrong):
    cfg = VARIANTS["renorm_untied_sharp"]
    path = make_checkpoint(tmp_path / "ckpt", cfg, seed=5)
    hf = load_hf_state_dict(path)
    state = hf_to_megatron(hf, cfg)
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        if wrong == "qkv_concatenated":
            parts = [hf[f"{h}self_attn.{p}_proj.weight"] for p in "qkv"]
            state[m + "self_attention.linear_qkv.weight"] = torch.cat(parts, dim=0)
        elif wrong == "gate_up_swapped":
            for e in range(cfg.num_experts):
                fe = f"{h}mlp.experts.{e}."
                fc1 = torch.cat([hf[fe + "up_proj.weight"], hf[fe + "gate_proj.weight"]], dim=0)
                state[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
        else:
            a, b = m + "self_attention.q_layernorm.weight", m + "self_attention.k_layernorm.weight"
            state[a], state[b] = state[b], state[a]
    model = build_model(cfg, ParallelConfig()).eval()
    load_global_state_dict(model, state)
    worst, mean = logprob_diff(model, _hf_reference(path), random_tokens(cfg.vocab_size, 4, 48, seed=1))
    print(f"negative control {wrong}: per-token |dlogprob| max={worst:.3e} mean={mean:.3e}")
    assert worst > 100 * TOLERANCE


def test_config_mismatch_is_refused(world_of_one, tmp_path):
    cfg = VARIANTS["renorm_untied"]
    path = make_checkpoint(tmp_path / "ckpt", cfg.replace(num_experts=4))
    model = build_model(cfg, ParallelConfig())
    with pytest.raises(ConversionError, match=r"num_experts: checkpoint 4 vs model 8"):
        load_hf_checkpoint(model, path)
    with pytest.raises(ConversionError, match=r"num_experts: checkpoint 4 vs model 8"):
        load_hf_checkpoint(model, path, cfg)
    good = make_checkpoint(tmp_path / "good", cfg)
    with pytest.raises(ConversionError, match=r"norm_topk_prob: checkpoint True vs model False"):
        load_hf_checkpoint(model, good, cfg.replace(norm_topk_prob=False))
    # config.json right, tensors wrong: the tensor is named.
    config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 16}))
    with pytest.raises(ConversionError, match=r"moe_ffn_hidden_size: checkpoint 16 vs model 32"):
        load_hf_checkpoint(model, good)


def test_export_round_trips_bit_exact_and_loads_in_transformers(world_of_one, tmp_path):
    cfg = VARIANTS["no_renorm_tied_sharp"]
    path = make_checkpoint(tmp_path / "ckpt", cfg, seed=9)
    model = build_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, path, cfg)
    out = export_hf_checkpoint(model, tmp_path / "export", cfg, max_shard_bytes=100_000)
    original, written = load_hf_state_dict(path), load_hf_state_dict(out)
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert (out / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert all(
        torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), reference.state_dict().values())
    )
    with pytest.raises(ConversionError, match="num_layers"):
        export_hf_checkpoint(model, tmp_path / "bad", cfg.replace(num_layers=3))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensors_are_refused_on_load_and_export(world_of_one, tmp_path, bad):
    cfg = VARIANTS["renorm_untied"]
    good = make_checkpoint(tmp_path / "ckpt", cfg, seed=3)
    state = load_hf_state_dict(good)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    state[name][3, 2] = bad
    poisoned = save_hf_state_dict(tmp_path / "poisoned", state, cfg)
    model = build_model(cfg, ParallelConfig()).eval()
    with pytest.raises(ConversionError, match=rf"tensor {name} has 1 non-finite value"):
        load_hf_checkpoint(model, poisoned, cfg)
    # Export: a good export first, then a parameter goes bad; the good export stays as it was.
    load_hf_checkpoint(model, good, cfg)
    out = export_hf_checkpoint(model, tmp_path / "export", cfg)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    params = dict(model.named_parameters())
    param = "decoder.layers.0.self_attention.linear_qkv.weight"
    with torch.no_grad():
        params[param][0, :2] = bad
    with pytest.raises(ConversionError, match=rf"refusing to export .*{param} has NaN/inf values .*kept"):
        export_hf_checkpoint(model, tmp_path / "export", cfg)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_name_table_covers_the_built_model_exactly(world_of_one):
    for cfg in (VARIANTS["renorm_untied"], VARIANTS["renorm_tied"]):
        model = build_model(cfg, ParallelConfig())
        assert {t.megatron for t in name_table(cfg)} == set(gather_global_state_dict(model))


def test_check_command(world_of_one, tmp_path, capsys):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", tiny(vocab_size=80, init_std=0.2))
    assert main(["--hf", str(path), "--check", "--length", "24"]) == 0
    out = capsys.readouterr().out
    assert "max=" in out and "OK" in out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_shapes_are_what_merging_the_hf_parts_gives(variant):
    from megatron_gspo.model.hf.convert import _megatron_shape, _merge

    cfg = VARIANTS[variant]
    for mapping in name_table(cfg):
        parts = [torch.empty(shape, device="meta") for shape in mapping.hf_shapes]
        assert _megatron_shape(mapping) == tuple(_merge(mapping, parts, cfg).shape), mapping.megatron


def test_the_first_path_of_the_conversion_check_still_runs(capsys, monkeypatch):
    """`python -m megatron_gspo.model.convert`, the check's path before `model/hf/`, runs the same command."""
    import runpy

    monkeypatch.setattr("sys.argv", ["convert", "--help"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("megatron_gspo.model.convert", run_name="__main__")
    assert ended.value.code == 0
    assert "HF Qwen3-MoE <-> Megatron conversion check" in capsys.readouterr().out
