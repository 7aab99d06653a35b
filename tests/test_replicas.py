"""Peer replicas: every commit's new objects copied into another node's local tier.

Two torchrun agents on this machine stand for two nodes (tests/replica_worker.py), one rank
each, each node its own tier directory in front of one store.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ckptstore
from ckptstore.errors import BadInputError
from ckptstore.tier.replicas import Peers
from tools.engines import free_port

WORKER = Path(__file__).with_name("replica_worker.py")


def two_nodes(root: Path) -> list[dict]:
    """Run the worker as two agents of one rank each (node ranks 0 and 1); each rank's observations."""
    port = free_port()
    result = root / "result"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(WORKER),
                str(root),
                str(result),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-5000:]
    return [json.loads(Path(f"{result}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def replicated_job(tmp_path_factory) -> list[dict]:
    return two_nodes(tmp_path_factory.mktemp("replicas"))


def test_each_nodes_tier_holds_the_other_nodes_share_of_every_step(replicated_job):
    for rank, seen in enumerate(replicated_job):
        peer = replicated_job[1 - rank]
        assert seen["node"] == str(rank)
        assert seen["errors"] == {} and seen["replicated"] == [1, 2, 3]
        # not uploaded yet (local_upload="drain"), and said to be on a peer too
        assert seen["pending"] == {"1": True, "2": True, "3": True}
        assert seen["locations"] == {"1": "local+peer", "2": "local+peer", "3": "local+peer"}
        for step in ("1", "2", "3"):
            held = seen["held_for_peer"][step]
            assert sorted(held) == sorted(peer["own_share"][step]), step  # the peer's whole share
            assert all(held.values()), step  # and every object of it is in this node's tier


def test_a_step_of_unchanged_state_moves_no_bytes_and_a_new_one_only_its_new_packs(replicated_job):
    for rank, seen in enumerate(replicated_job):
        moved = seen["moved"]
        assert moved["2"] == {"sent": 0, "received": 0, "objects": 0}, rank
        assert moved["1"]["sent"] == sum(seen["own_share"]["1"].values())  # all of it was new there
        assert moved["1"]["received"] == sum(replicated_job[1 - rank]["own_share"]["1"].values())
        assert 0 < moved["3"]["sent"] <= sum(seen["own_share"]["3"].values())


def test_on_one_node_nothing_is_copied_and_no_step_is_called_replicated(tmp_path):
    result = tmp_path / "result"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(WORKER), str(tmp_path), str(result)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "copied nowhere" in proc.stderr
    for rank in (0, 1):
        seen = json.loads(Path(f"{result}.{rank}.json").read_text())
        assert seen["replicated"] == [] and seen["moved"] == {} and seen["held_for_peer"] == {}
        assert set(seen["pending"].values()) == {False} and set(seen["locations"].values()) == {"local"}


def test_peers_are_the_same_local_rank_on_the_next_nodes_of_a_ring():
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert Peers.of(nodes, 1, 1) == Peers(send_to=[3], receive_from=[5])
    assert Peers.of(nodes, 4, 2) == Peers(send_to=[0, 2], receive_from=[2, 0])
    assert Peers.of(nodes, 0, 5) == Peers(send_to=[2, 4], receive_from=[4, 2])  # no two copies on one node
    assert Peers.of(["a", "a"], 0, 1) == Peers(send_to=[], receive_from=[])  # one node: no peer


def test_replicas_need_a_local_tier(tmp_path):
    with pytest.raises(BadInputError, match="local="):
        ckptstore.open(tmp_path / "store", replicas=1)
