"""A checkpoint written at TP2 resumes at EP2, at TP1 x EP1 and at PP2 (and one written at PP2
resumes at EP2): same weights, Adam state, log-probs.

Each layout runs in its own process (torchrun, gloo, 2 workers; world 1 without torchrun).
References are independent of `dist_checkpointing`: global weights and Adam moments are
gathered with the sharding code, and the log-probs of the resumed model are compared with a
fresh model of the same layout given the saved global weights through `load_global_state_dict`.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun
from warm_python import python

WORKER = Path(__file__).with_name("reshard_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CROSS_LAYOUT_TOLERANCE = 1e-5  # TP splits reductions differently: rounding, not state


def _launch(
    mode, root, out, *, tp=1, ep=1, pp=1, vpp=None, layers=None, distopt=False, reference=None, steps=2,
    first_root=None,
):  # fmt: skip
    world = tp * ep * pp
    cmd = [
        *(torchrun(world, WORKER) if world > 1 else [*python(), str(WORKER)]),
        mode,
        "--root",
        str(root),
        "--out",
        str(out),
        "--tp",
        str(tp),
        "--ep",
        str(ep),
        "--pp",
        str(pp),
    ]
    cmd += (["--vpp", str(vpp)] if vpp else []) + (["--layers", str(layers)] if layers else [])
    cmd += ["--distopt"] * distopt + (["--reference", str(reference)] if reference else [])
    cmd += ["--steps", str(steps)] if mode == "save" else []
    cmd += ["--first-root", str(first_root)] if first_root else []
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(f"{out}.pt", weights_only=False), done.stderr


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory):
    """`saved_at(**layout)`: a `save` run of that layout, launched once for the module's tests.

    Returns (checkpoint root, the save run's result, its global weights as a `--reference` file)
    after two steps; `saved_at(**layout, first=True)` the same for the checkpoint that run wrote
    before its first optimizer step. `load` runs only read the roots.
    """
    runs = {}

    def get(first=False, **layout):
        key = tuple(sorted(layout.items()))
        if key not in runs:
            folder = tmp_path_factory.mktemp("saved")
            result, _ = _launch(
                "save", folder / "ckpt", folder / "saved", first_root=folder / "ckpt0", **layout
            )
            result0 = torch.load(folder / "saved_step0.pt", weights_only=False)
            for name, saved in (("weights.pt", result), ("weights0.pt", result0)):
                torch.save(saved["weights"], folder / name)
            runs[key] = {
                False: (folder / "ckpt", result, folder / "weights.pt"),
                True: (folder / "ckpt0", result0, folder / "weights0.pt"),
            }
        return runs[key][first]

    return get


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiprocess
@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_tp2_checkpoint_resumes_at_ep2_and_at_world_one(tmp_path, saved_at, distopt):
    root, saved, reference = saved_at(tp=2, distopt=distopt)
    assert saved["adam_step"] == 2 and saved["trainer_step"] == 2
    for name, layout in {"ep2": {"ep": 2}, "tp1ep1": {}}.items():
        resumed, log = _launch("load", root, tmp_path / name, distopt=distopt, reference=reference, **layout)
        assert "random streams are not restored" in log, name
        weights = resumed["weights"]
        assert weights.keys() == saved["weights"].keys()
        assert all(torch.equal(weights[k], saved["weights"][k]) for k in weights), name
        assert resumed["adam_step"] == 2 and resumed["scheduler_steps"] == saved["scheduler_steps"] == 2
        assert resumed["trainer_step"] == 2
        if not distopt:
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = resumed["moments"][key], saved["moments"][key]
                assert got.keys() == want.keys()
                assert all(torch.equal(got[k], want[k]) for k in got), (name, key)
                assert any(want[k].abs().max() > 0 for k in want)  # moments of a real run
        # Identical log-probs: the resumed model vs the same layout given the saved weights.
        assert torch.equal(resumed["logprobs"], resumed["reference_logprobs"]), name
        assert (resumed["logprobs"] - saved["logprobs"]).abs().max().item() <= CROSS_LAYOUT_TOLERANCE
        # One more Adam step lands where the saving layout's does: moments and step restored
        # (fresh moments would move each weight by about the learning rate, 1e-2).
        after, before = resumed["weights_after_step"], saved["weights_after_step"]
        assert _max_diff(after, before) <= CROSS_LAYOUT_TOLERANCE, name
        assert _max_diff(after, weights) > 1e-4


def _assert_resumed_like_saved(resumed: dict, saved: dict, name: str, *, moments: bool = True) -> None:
    weights = resumed["weights"]
    assert weights.keys() == saved["weights"].keys()
    assert all(torch.equal(weights[k], saved["weights"][k]) for k in weights), name
    assert resumed["adam_step"] == saved["adam_step"] == 2 and resumed["trainer_step"] == 2
    assert resumed["scheduler_steps"] == saved["scheduler_steps"] == 2
    if moments:
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = resumed["moments"][key], saved["moments"][key]
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in got), (name, key)
            assert any(want[k].abs().max() > 0 for k in want)
    assert torch.equal(resumed["logprobs"], resumed["reference_logprobs"]), name
    diff = (resumed["logprobs"] - saved["logprobs"]).abs().max().item()
    assert diff <= CROSS_LAYOUT_TOLERANCE, (name, diff)
    after, before = resumed["weights_after_step"], saved["weights_after_step"]
    assert _max_diff(after, before) <= CROSS_LAYOUT_TOLERANCE, name
    assert _max_diff(after, weights) > 1e-4
    print(
        f"{name}: max |d logprob| vs the saving layout {diff:.2e}, "
        f"after one more step {_max_diff(after, before):.2e}"
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_tp2_checkpoint_resumes_at_pp2(tmp_path, saved_at, distopt):
    """Each stage loads its layers by their global keys, Adam state included (the TP2 checkpoint
    is the one the EP2 / world-of-one test resumes)."""
    root, saved, reference = saved_at(tp=2, distopt=distopt)
    resumed, log = _launch("load", root, tmp_path / "pp2", pp=2, distopt=distopt, reference=reference)
    assert "random streams are not restored" in log and "PP=2" in log
    _assert_resumed_like_saved(
        resumed, saved, "TP2 -> PP2" + " (distributed optimizer)" * distopt, moments=not distopt
    )


@pytest.mark.multiprocess
def test_pp2_checkpoint_resumes_at_ep2(tmp_path):
    """The stages' layers merge back into one model whose experts split over EP instead."""
    saved, _ = _launch("save", tmp_path / "from_pp2", tmp_path / "pp2_saved", pp=2)
    torch.save(saved["weights"], tmp_path / "pp2_weights.pt")
    resumed, _ = _launch(
        "load", tmp_path / "from_pp2", tmp_path / "ep2", ep=2, reference=tmp_path / "pp2_weights.pt"
    )
    _assert_resumed_like_saved(resumed, saved, "PP2 -> EP2")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_pp2_vpp2_checkpoint_resumes_at_world_one(tmp_path, distopt):
    """Each model chunk saves its layers under their global keys (`model0`, `model1`): a PP2 x 2
    chunks checkpoint of a 4-layer model loads into one whole model, Adam state included."""
    saved, _ = _launch(
        "save", tmp_path / "from_vpp", tmp_path / "vpp_saved", pp=2, vpp=2, layers=4, distopt=distopt
    )
    torch.save(saved["weights"], tmp_path / "vpp_weights.pt")
    resumed, _ = _launch(
        "load", tmp_path / "from_vpp", tmp_path / "world1", layers=4, distopt=distopt,
        reference=tmp_path / "vpp_weights.pt",
    )  # fmt: skip
    _assert_resumed_like_saved(resumed, saved, "PP2 x VPP2 -> world of one", moments=not distopt)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_tp2_checkpoint_saved_before_the_first_optimizer_step_resumes_at_ep2(tmp_path, saved_at, distopt):
    """No optimizer state exists yet: the weights reshard and the optimizer stays fresh.

    (The checkpoint the TP2 save run wrote before its first step. The run's first step has
    learning rate 0 in warm-up, so the continuation is checked by the world-1 test in
    `test_checkpoint_resume.py`, which trains two steps after the resume.)
    """
    root, saved, reference = saved_at(tp=2, distopt=distopt, first=True)
    assert saved["adam_step"] is None and saved["trainer_step"] == 0
    resumed, _ = _launch("load", root, tmp_path / "ep2", ep=2, distopt=distopt, reference=reference)
    weights = resumed["weights"]
    assert weights.keys() == saved["weights"].keys()
    assert all(torch.equal(weights[k], saved["weights"][k]) for k in weights)
    assert resumed["adam_step"] is None and resumed["trainer_step"] == 0
    assert resumed["scheduler_steps"] == saved["scheduler_steps"] == 0
    assert torch.equal(resumed["logprobs"], resumed["reference_logprobs"])
    assert (resumed["logprobs"] - saved["logprobs"]).abs().max().item() <= CROSS_LAYOUT_TOLERANCE
