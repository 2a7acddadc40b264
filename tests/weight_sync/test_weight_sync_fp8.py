"""rollout.quantization=fp8: the weight sync sends blockwise FP8 and the embedded server serves it."""

import shutil

import pytest
import torch
from fp8_reference import reference_dequantize, reference_quantize
from safetensors.torch import save_file
from served import served_logprobs
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.convert import random_tokens
from megatron_gspo.model.hf.stream import iter_hf_tensors
from megatron_gspo.plan import sync_bytes
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.weight_sync.sync import WeightSync

CFG = tiny(vocab_size=80, init_std=0.2)
TOKENS = random_tokens(CFG.vocab_size, batch=2, length=16, seed=5)
PROJECTION = ("_proj.weight",)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=5) as (model, checkpoint):
        server = launch_embedded_server(checkpoint)
        client = SGLangClient([server.url], max_retries=0)
        yield model, client, checkpoint, tmp_path_factory.mktemp("work")
        client.close()
        server.terminate()


def sync(model, work, client, version: int, quantization: str, method: str = "distributed"):
    cfg = WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=60)
    return WeightSync(cfg, model, CFG, work / "export", quantization=quantization).sync(client, version)


def reference_checkpoint(model, checkpoint, out):
    """The trainer's weights with every decoder projection dequantised by the test's reference."""
    shutil.copytree(checkpoint, out)
    state, expected_bytes = {}, 0
    for name, tensor in iter_hf_tensors(model, CFG, sender=True):
        tensor = tensor.detach().cpu()
        if name.startswith("model.layers.") and name.endswith(PROJECTION):
            q, scale = reference_quantize(tensor)
            state[name] = reference_dequantize(q, scale).to(tensor.dtype)
            expected_bytes += q.numel() + scale.numel() * 4
        else:
            state[name] = tensor.clone()
            expected_bytes += tensor.numel() * tensor.element_size()
    for old in out.glob("*.safetensors*"):
        old.unlink()
    save_file(state, str(out / "model.safetensors"))
    return out, expected_bytes


@pytest.mark.slow
def test_fp8_sync_serves_the_dequantised_weights_and_a_small_real_mismatch(setup):
    model, client, checkpoint, work = setup
    full = sync(model, work, client, 1, "none")
    exact = served_logprobs(client, TOKENS)

    fp8 = sync(model, work, client, 2, "fp8")
    assert client.model_info()[0]["weight_version"] == "2"
    served = served_logprobs(client, TOKENS)

    reference_dir, expected_bytes = reference_checkpoint(model, checkpoint, work / "reference")
    client.update_weights_from_disk(str(reference_dir), weight_version="3")
    # Bit for bit: the served FP8 weights give exactly the reference's log-probs.
    assert torch.equal(served_logprobs(client, TOKENS), served)
    sync(model, work, client, 4, "fp8", method="tensor")  # the handles carry float8 too
    assert torch.equal(served_logprobs(client, TOKENS), served)

    gap = (served - exact).abs()
    print(
        f"fp8 vs full-precision served log-probs: max |diff| {gap.max():.3e}, mean {gap.mean():.3e} "
        f"(mean |log-prob| {exact.abs().mean():.3f}); sync bytes fp8 {fp8.bytes}, unquantised {full.bytes}"
    )
    # The real FP8 rounding (up to 1/16 of each weight): a gap, small against the log-probs.
    assert 0 < gap.mean() < 0.05 * exact.abs().mean()
    assert fp8.bytes == expected_bytes  # FP8 values + float32 scales
    assert fp8.bytes == sync_bytes(CFG, 4, "fp8") and full.bytes == sync_bytes(CFG, 4)  # plan's count
