"""`rollout.placement: colocated` start-up checks, and the optimizer-offload options, refused by name."""

from pathlib import Path

import pytest

from megatron_gspo.config import load_config, validate
from megatron_gspo.config.colocation import ColocationError
from megatron_gspo.errors import ConfigError
from megatron_gspo.model.optim import OptimConfig

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "tiny_moe_cpu.yaml"
COLOCATED = ["rollout.placement=colocated", "weight_sync.method=tensor"]


def check(overrides, world_size=2):
    validate(load_config(DEMO, overrides), world_size=world_size)


def test_a_colocated_demo_run_is_accepted():
    check(COLOCATED)
    check([*COLOCATED, "rollout.server_tensor_parallel=2"])


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["rollout.placement=colocated"], "needs weight_sync.method=tensor, got distributed"),
        ([*COLOCATED, "rollout.max_staleness=1"], "needs rollout.max_staleness=0, got 1"),
        (
            [*COLOCATED, "rollout.server_tensor_parallel=4"],
            "rollout.server_tensor_parallel=4 does not divide",
        ),
        (
            [*COLOCATED, "rollout.server_urls=[http://a:1]"],
            "1 servers x rollout.server_tensor_parallel=1 cover 1",
        ),
    ],
)
def test_what_colocation_cannot_do_is_refused_by_name(overrides, named):
    with pytest.raises(ColocationError, match="rollout.placement=colocated") as err:
        check(overrides)
    assert named in str(err.value)


def test_embedded_servers_on_two_nodes_are_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ColocationError, match="embedded servers on one node only"):
        check(COLOCATED, world_size=4)


def test_optimizer_offload_options():
    with pytest.raises(
        ConfigError, match="use_precision_aware_optimizer needs parallel.distributed_optimizer"
    ):
        check(["optim.use_precision_aware_optimizer=true"], world_size=1)
    with pytest.raises(ValueError, match="need optim.optimizer=adam"):
        OptimConfig(optimizer="sgd", optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="overlap_cpu_optimizer_d2h_h2d needs optim.optimizer_cpu_offload"):
        OptimConfig(overlap_cpu_optimizer_d2h_h2d=True)
    with pytest.raises(ValueError, match="optimizer_offload_fraction must be in"):
        OptimConfig(optimizer_offload_fraction=1.5)
    if not __import__("torch").cuda.is_available():  # megatron's HybridDeviceOptimizer builds CUDA streams
        with pytest.raises(ValueError, match="optimizer_cpu_offload needs CUDA"):
            OptimConfig(optimizer_cpu_offload=True).check_hardware()


class _Servers:
    """What `handle_sources` reads of a client: the servers' URLs and their /server_info."""

    def __init__(self, *layouts):
        self.urls = [f"http://s{i}" for i in range(len(layouts))]
        self.infos = [{"tp_size": tp, "base_gpu_id": base, "gpu_id_step": step} for tp, base, step in layouts]

    def server_info(self):
        return self.infos


def one_node(gpus: int, servers: int) -> list[tuple[int, list[bool]]]:
    """Every rank of one node: on GPU `rank`, every server on its host."""
    return [(gpu, [True] * servers) for gpu in range(gpus)]


def test_each_server_rank_takes_the_trainer_rank_on_its_gpu():
    from megatron_gspo.weight_sync.tensors import handle_sources

    # One node of 4: servers in any GPU order (SGLang's placement: base_gpu_id + r * gpu_id_step).
    assert handle_sources(_Servers((2, 2, 1), (2, 0, 1)), one_node(4, 2)) == [[2, 3], [0, 1]]
    assert handle_sources(_Servers((2, 0, 2), (2, 1, 2)), one_node(4, 2)) == [[0, 2], [1, 3]]
    with pytest.raises(
        ColocationError, match=r"servers http://s0 and http://s1 both have a rank on GPU 1 of trainer rank 1"
    ):
        handle_sources(_Servers((2, 0, 1), (2, 1, 1)), one_node(4, 2))
    with pytest.raises(
        ColocationError, match=r"http://s0 \(tp_size=2, base_gpu_id=3, .*GPU 4 of its host, where"
    ):
        handle_sources(_Servers((2, 3, 1)), one_node(4, 1))
    with pytest.raises(ColocationError, match=r"server http://s1 runs on no host of the trainer's ranks"):
        handle_sources(_Servers((4, 0, 1), (4, 0, 1)), [(gpu, [True, False]) for gpu in range(4)])


def test_servers_are_matched_to_the_ranks_on_their_own_host_not_by_the_nodes_join_order():
    from megatron_gspo.weight_sync.tensors import handle_sources

    # Two nodes of 4; c10d numbered node B first (ranks 0-3), the servers are listed A then B.
    node_b = [(gpu, [False, True]) for gpu in range(4)]
    node_a = [(gpu, [True, False]) for gpu in range(4)]
    servers = _Servers((4, 0, 1), (4, 0, 1))
    assert handle_sources(servers, node_b + node_a) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    # A localhost URL is local on every node: two ranks on its GPU 0, refused by name.
    everywhere = [(gpu, [True]) for gpu in range(4)] * 2
    with pytest.raises(ColocationError, match=r"GPU 0 of its host, where trainer ranks \[0, 4\] are"):
        handle_sources(_Servers((4, 0, 1)), everywhere)


@pytest.mark.parametrize(
    ("url", "here"),
    [
        ("http://127.0.0.1:30000", True),
        ("http://localhost:30000", True),
        ("http://203.0.113.5:30000", False),  # TEST-NET-3: never this host
    ],
)
def test_a_server_is_on_this_host_when_its_address_is_ours(url, here):
    from megatron_gspo.weight_sync.tensors import on_this_host

    assert on_this_host(url) is here


def test_this_hosts_own_address_is_on_this_host():
    import socket

    from megatron_gspo.weight_sync.tensors import on_this_host

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # our address on the default route
        try:
            sock.connect(("203.0.113.5", 9))
        except OSError:
            pytest.skip("no route off this host")
        ours = sock.getsockname()[0]
    assert on_this_host(f"http://{ours}:30000")
