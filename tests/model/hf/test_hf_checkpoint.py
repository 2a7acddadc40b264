import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import (
    SAFE_WEIGHTS_INDEX_NAME,
    ExportTargetError,
    build_hf_model,
    copy_into_model,
    first_non_finite,
    hf_to_module_state,
    load_hf_state_dict,
    main,
    make_tiny_hf_checkpoint,
    module_state_to_hf,
    save_hf_state_dict,
)
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_checkpoint_loads_in_transformers_bit_exact(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", CFG, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert _same_state(loaded, build_hf_model(CFG, seed=3))
    assert not _same_state(loaded, build_hf_model(CFG, seed=4))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2 and cfg["vocab_size"] == len(TOKENIZER)
    gen = GenerationConfig.from_pretrained(path)
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (2, 0, 1)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.encode("12+3=") == TOKENIZER.encode("12+3=")


def test_on_disk_names_match_transformers_save_pretrained(tmp_path):
    model = build_hf_model(CFG, seed=0)
    model.save_pretrained(tmp_path / "hf")
    reference = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = module_state_to_hf(model.state_dict())
    assert ours.keys() == reference.keys()
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in ours
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    back = hf_to_module_state(ours, CFG.num_experts)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_sharded_save_round_trips_and_loads_in_transformers(tmp_path):
    model = build_hf_model(CFG, seed=1)
    state = module_state_to_hf(model.state_dict())
    path = save_hf_state_dict(tmp_path / "sharded", state, CFG, TOKENIZER, max_shard_bytes=100_000)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(state)
    loaded = load_hf_state_dict(path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert _same_state(AutoModelForCausalLM.from_pretrained(path), model)


def test_failed_save_leaves_existing_checkpoint_intact(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", CFG, seed=0)
    before = load_hf_state_dict(path)
    other = module_state_to_hf(build_hf_model(CFG, seed=1).state_dict())
    small = CFG.replace(vocab_size=10)  # tokenizer does not fit -> fails after the shards were written
    with pytest.raises(ValueError, match="tokenizer has 79 tokens"):
        save_hf_state_dict(path, other, small, TOKENIZER)
    after = load_hf_state_dict(path)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directories left
    # A successful save replaces the checkpoint as a whole.
    save_hf_state_dict(path, other, CFG, TOKENIZER)
    assert torch.equal(load_hf_state_dict(path)["lm_head.weight"], other["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_directory_that_is_not_an_export_is_never_replaced(tmp_path):
    target = tmp_path / "run"
    (target / "checkpoints").mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    state = module_state_to_hf(build_hf_model(CFG, seed=1).state_dict())
    with pytest.raises(
        ExportTargetError, match=r"not an earlier HF export \(it holds checkpoints/, notes.txt\)"
    ):
        save_hf_state_dict(target, state, CFG, TOKENIZER)
    assert sorted(p.name for p in target.iterdir()) == ["checkpoints", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary directory left
    empty = tmp_path / "empty"
    empty.mkdir()
    save_hf_state_dict(empty, state, CFG, TOKENIZER)  # an empty directory is taken
    save_hf_state_dict(empty, state, CFG, TOKENIZER)  # and so is an earlier export
    assert torch.equal(load_hf_state_dict(empty)["lm_head.weight"], state["lm_head.weight"])


def test_an_hf_model_another_tool_saved_is_replaced_only_when_asked(tmp_path):
    """Same file names as an export (config.json, model.safetensors, tokenizer): told apart by
    the export's marker, so a base model given as the target by mistake is not overwritten."""
    base = tmp_path / "base"
    build_hf_model(CFG, seed=1).save_pretrained(base)  # transformers' own writer
    TOKENIZER.save_pretrained(base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    state = module_state_to_hf(build_hf_model(CFG, seed=2).state_dict())
    with pytest.raises(ExportTargetError, match="holds an HF model that megatron-gspo did not write"):
        save_hf_state_dict(base, state, CFG, TOKENIZER)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no temporary directory left
    save_hf_state_dict(base, state, CFG, TOKENIZER, overwrite=True)
    assert torch.equal(load_hf_state_dict(base)["lm_head.weight"], state["lm_head.weight"])
    save_hf_state_dict(base, state, CFG, TOKENIZER)  # now an export: replaced without being asked


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=32 is smaller than the tokenizer"):
        make_tiny_hf_checkpoint(tmp_path / "x", tiny(), TOKENIZER)


def test_load_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_state_dict(tmp_path / "nope")


def test_copy_into_model_partial_expert_update_lands_in_fused_rows():
    model = build_hf_model(CFG, seed=0)
    inter = CFG.moe_ffn_hidden_size
    gate = torch.randn(inter, CFG.hidden_size)
    down = torch.randn(CFG.hidden_size, inter)
    before = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    copy_into_model(
        model,
        {
            "model.layers.1.mlp.experts.5.gate_proj.weight": gate,
            "model.layers.1.mlp.experts.5.down_proj.weight": down,
        },
    )
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj[5, :inter], gate)
    assert torch.equal(experts.gate_up_proj[5, inter:], before[5, inter:])  # up rows untouched
    assert torch.equal(experts.gate_up_proj[4], before[4])
    assert torch.equal(experts.down_proj[5], down)
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        copy_into_model(model, {"model.norm.weight": torch.ones(3)})
    with pytest.raises(KeyError, match="model.bogus"):
        copy_into_model(model, {"model.bogus": torch.ones(3)})


def test_command_line_writes_a_loadable_checkpoint(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "cli"), "--seed", "2"]) == 0
    assert "parameters" in capsys.readouterr().out
    assert _same_state(AutoModelForCausalLM.from_pretrained(tmp_path / "cli"), build_hf_model(CFG, seed=2))


def test_first_non_finite_names_the_first_offender_and_clears_huge_finite_tensors():
    huge = torch.full((4,), 3e38)  # finite, but its norm overflows to inf: the exact pass clears it
    tensors = {
        "a": torch.randn(3, 4),
        "huge": huge,
        "ids": torch.tensor([1, 2]),  # not floating point: nothing to check
        "bf16": torch.randn(5).bfloat16(),
        "empty": torch.empty(0),
    }
    assert first_non_finite(tensors) is None
    nan, inf = torch.randn(6), torch.randn(2).bfloat16()
    nan[4], inf[1] = math.nan, -math.inf
    assert first_non_finite({**tensors, "inf": inf, "nan": nan}) == "inf"
    assert first_non_finite({"nan": nan, **tensors, "inf": inf}) == "nan"
