"""Peer replicas: every commit's new objects copied into another node's local tier.

Two torchrun agents on this machine stand for two nodes (tests/replica_worker.py), one rank
each, each node its own tier directory in front of one store.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, CorruptError, StorageError
from ckptstore.format import pack
from ckptstore.format.layout import file_name, pack_name
from ckptstore.objects.local import LocalObjectStore
from ckptstore.objects.tiered import share_name
from ckptstore.tier.prune import prune
from ckptstore.tier.recover import intact
from ckptstore.tier.replicas import Peers, parse_names, read_held, replicas_name
from tests.moto_s3 import S3_ENV
from tools.engines import free_port, two_node_agents
from tools.netproxy import Proxy

WORKER = Path(__file__).with_name("replica_worker.py")


def two_nodes(
    root: Path, mode: str = "replicate", env: dict | None = None, killed: bool = False
) -> list[dict]:
    """Run the worker as two nodes of one rank each (``two_node_agents``); each rank's
    observations. ``killed``: the ranks SIGKILL themselves (the agents fail)."""
    result = root / f"result-{mode}"
    agents = two_node_agents([str(WORKER), mode, str(root), str(result)], env, timeout=600)
    failed = [output[-4000:] for code, output in agents if (code != 0) != killed]
    assert not failed, "\n".join(failed)
    return [json.loads(Path(f"{result}.{rank}.json").read_text()) for rank in (0, 1)]


def one_node(root: Path, mode: str, result: Path) -> subprocess.CompletedProcess:
    """Run the worker as one agent of two ranks (one node)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(WORKER), mode, str(root), str(result)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def replicated_job(tmp_path_factory) -> list[dict]:
    return two_nodes(tmp_path_factory.mktemp("replicas"))


def test_each_nodes_tier_holds_the_other_nodes_share_of_every_step(replicated_job):
    for rank, seen in enumerate(replicated_job):
        peer = replicated_job[1 - rank]
        assert seen["node"] == str(rank)
        assert seen["errors"] == {} and seen["replicated"] == [1, 2, 3] and seen["dcp_replicated"]
        # not uploaded yet (local_upload="drain"), and said to be on a peer too
        assert seen["pending"] == {"1": True, "2": True, "3": True}
        assert seen["locations"] == {"1": "local+peer", "2": "local+peer", "3": "local+peer"}
        for step in ("1", "2", "3", "10"):  # 10: a DCP save
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
    proc = one_node(tmp_path, "replicate", result)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "copied nowhere" in proc.stderr
    for rank in (0, 1):
        seen = json.loads(Path(f"{result}.{rank}.json").read_text())
        assert seen["replicated"] == [] and seen["moved"] == {} and seen["held_for_peer"] == {}
        assert set(seen["pending"].values()) == {False} and set(seen["locations"].values()) == {"local"}


def test_a_peer_that_stops_answering_leaves_the_step_local_after_the_timeout_not_a_hang(tmp_path):
    result = tmp_path / "result"
    proc = one_node(tmp_path, "stuck", result)
    assert proc.returncode != 0  # rank 1 was killed
    seen = json.loads(Path(f"{result}.0.json").read_text())
    assert 3 <= seen["waited"] < 60
    assert "rank 1 did not answer within 3 s" in seen["errors"]["1"]
    assert seen["pending"] == {"1": False} and seen["locations"] == {
        "1": "local"
    }  # durable here, uploads later


def test_peers_are_the_same_local_rank_on_the_next_nodes_of_a_ring():
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert Peers.of(nodes, 1, 1) == Peers(send_to=[3], receive_from=[5])
    assert Peers.of(nodes, 4, 2) == Peers(send_to=[0, 2], receive_from=[2, 0])
    assert Peers.of(nodes, 0, 5) == Peers(send_to=[2, 4], receive_from=[4, 2])  # no two copies on one node
    assert Peers.of(["a", "a"], 0, 1) == Peers(send_to=[], receive_from=[])  # one node: no peer


def test_replicas_need_a_local_tier(tmp_path):
    with pytest.raises(BadInputError, match="local="):
        ckptstore.open(tmp_path / "store", replicas=1)


@pytest.fixture(scope="module")
def recovered_job(tmp_path_factory, s3_server) -> dict:
    """Acceptance 1 and 2 of peer recovery, through a proxy that counts S3 requests: two nodes
    commit steps 1-2 (uploaded) and 3-4 (replicated only) and are SIGKILLed; node 1's tier is
    deleted (a replaced node) and the job restores with S3 cut off; node 1 is replaced again and
    one of node 0's replicas damaged, and the job restores step 2; then both tiers are deleted
    and it restores."""
    endpoint, admin = s3_server
    root = tmp_path_factory.mktemp("recovery")
    bucket = f"recovery-{uuid.uuid4().hex[:12]}"
    admin.create_bucket(Bucket=bucket)
    with Proxy.for_endpoint(endpoint) as proxy:
        env = {
            **os.environ,
            **S3_ENV,
            "AWS_ENDPOINT_URL": proxy.endpoint,
            "CKPTSTORE_STORE": f"s3://{bucket}/run",
        }
        seen = {"before": two_nodes(root, "commit", env, killed=True)}
        for tier in ("nvme", "dcp", "cache"):
            shutil.rmtree(root / f"{tier}-node1", ignore_errors=True)
        proxy.reset_counters()
        proxy.cut()  # S3 unreachable: a connection is reset as it arrives
        seen["replaced"] = two_nodes(root, "restore", {**env, "DCP": "1", "CKPTSTORE_S3_MAX_ATTEMPTS": "1"})
        seen["replaced_requests"] = list(proxy.requests)
        proxy.restore()
        # Node 1 replaced again, and node 0's copy of the biggest object of its step-2 share
        # damaged: that one is read from S3 (step 2 was uploaded), the rest from node 0.
        shutil.rmtree(root / "nvme-node1")
        held = json.loads((root / "nvme-node0" / replicas_name(2, 1)).read_text())
        seen["damaged"] = damaged = max(held, key=held.get)
        with open(root / "nvme-node0" / damaged, "r+b") as replica:
            replica.seek(held[damaged] // 2)
            replica.write(b"\xff" * 64)
        proxy.reset_counters()
        seen["damaged_replica"] = two_nodes(root, "restore", {**env, "RESTORE_STEP": "2"})
        seen["damaged_requests"] = list(proxy.requests)
        for node in (0, 1):
            shutil.rmtree(root / f"nvme-node{node}")
            shutil.rmtree(root / f"cache-node{node}", ignore_errors=True)
        seen["both_lost"] = two_nodes(root, "restore", env)
    return seen


def test_a_replaced_node_restores_the_newest_step_from_its_peer_with_s3_unreachable(recovered_job):
    before, after = recovered_job["before"], recovered_job["replaced"]
    assert [seen["pending"] for seen in before] == [[3, 4], [3, 4]]
    assert [seen["replicated"] for seen in before] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    for rank in (0, 1):
        assert after[rank]["step"] == 4
        assert after[rank]["digest"] == before[rank]["digest"]  # every tensor the step holds
        assert after[rank]["losses"] == before[rank]["losses"]  # as if it never stopped
    node0, node1 = (seen["sources"] for seen in after)
    assert node0["peers"] == {} and node0["remote"] == 0 and node0["tier"] > 0
    assert node1["tier"] == 0 and node1["remote"] == 0 and node1["corrupt"] == []
    assert list(node1["peers"]) == ["0"] and node1["peers"]["0"] > 0  # all of it from node 0's replicas
    # Its own shares of the steps not uploaded are back in its tier, so that they upload later.
    assert after[1]["own_shares"] == {"3": True, "4": True}
    assert recovered_job["replaced_requests"] == []  # S3 could not be reached, and was not needed


def test_a_replaced_node_loads_the_dcp_doors_newest_step_from_its_peer(recovered_job):
    assert [seen["dcp_replicated"] for seen in recovered_job["before"]] == [[7], [7]]
    node0, node1 = (seen["dcp_sources"] for seen in recovered_job["replaced"])
    assert [seen["dcp_loaded"] for seen in recovered_job["replaced"]] == [True, True]
    assert node0["step"] == node1["step"] == 7 and node0["peers"] == {} and node0["remote"] == 0
    assert node1["tier"] == 0 and node1["remote"] == 0 and list(node1["peers"]) == ["0"]


def test_a_damaged_replica_is_refused_and_read_from_the_next_source(recovered_job):
    node0, node1 = (seen["sources"] for seen in recovered_job["damaged_replica"])
    assert [seen["step"] for seen in recovered_job["damaged_replica"]] == [2, 2]
    assert node1["corrupt"] == [recovered_job["damaged"]]  # detected: its content key does not match
    assert node1["remote"] > 0 and node1["peers"]["0"] > 0  # that one from S3, the rest from node 0
    requests = recovered_job["damaged_requests"]
    packs_read = [line for line in requests if line.startswith("GET") and "/packs/" in line]
    assert packs_read and all(line.endswith(recovered_job["damaged"]) for line in packs_read)
    assert node0["corrupt"] == [] and node0["remote"] == 0


def test_with_both_tiers_lost_the_job_restores_the_newest_uploaded_step_from_s3(recovered_job):
    for seen in recovered_job["both_lost"]:
        assert seen["step"] == 2
        assert (
            seen["sources"]["tier"] == 0 and seen["sources"]["peers"] == {} and seen["sources"]["remote"] > 0
        )


def test_a_fresh_tier_opens_before_an_unreachable_store_only_for_a_job_with_replicas(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(StorageError):
        ckptstore.open("s3://bucket/run", local=tmp_path / "new-tier")
    store = ckptstore.open("s3://bucket/run", local=tmp_path / "replaced-node", replicas=1)
    assert store.tier.local.exists("tier/remote.json") and store.steps() == []
    store.close()


def test_a_peers_object_is_taken_only_if_it_hashes_to_its_name(tmp_path):
    objects = ckptstore.open(tmp_path / "store").objects
    key, parts, _ = pack.encode_parts([("w", "fp32", 0, torch.arange(8.0))])
    data = b"".join(bytes(part) for part in parts)
    name = pack_name(key)
    assert intact(name, name, data, objects, 32) is None  # the 32 bytes of tensors its catalog records
    damaged = bytearray(data)
    damaged[-3] ^= 0xFF
    assert "corrupt" in intact(name, name, bytes(damaged), objects, 32)
    # the sizes bound the decode: another size, or none recorded, and nothing is decompressed
    assert "referrer records 16" in intact(name, name, data, objects, 16)
    assert "records no size" in intact(name, name, data, objects)
    assert "corrupt" in intact(file_name("0" * 32), file_name("0" * 32), b"not it", objects)
    share = json.dumps({name: len(data)}).encode()
    assert intact(share_name(4, 1), replicas_name(4, 1), share, objects) is None  # a replica record
    assert "corrupt" in intact(share_name(4, 1), replicas_name(4, 1), b'{"/etc/passwd": 1}', objects)


@pytest.mark.parametrize(
    "nested", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000]
)
def test_a_deeply_nested_share_list_from_a_peer_is_corrupt_not_a_recursion_error(tmp_path, nested):
    # Recovery asks the next holder when a peer's replica record is corrupt; a RecursionError
    # would end this rank's restore and leave the others waiting until the peer timeout.
    objects = ckptstore.open(tmp_path / "store").objects
    assert "corrupt" in intact(share_name(4, 1), replicas_name(4, 1), nested, objects)
    with pytest.raises(CorruptError, match="rank 1 sent a list of objects nested too deeply"):
        parse_names(nested, "rank 1")  # what replicate makes of a peer's list of names
    local = LocalObjectStore(tmp_path / "tier", create=True)
    local.put_if_absent(replicas_name(4, 1), nested)  # a record planted in a tier: prune reads it
    with pytest.raises(CorruptError, match="nested too deeply"):
        read_held(local, 4, 1)


def test_a_peers_replicas_of_a_step_this_node_has_no_manifest_of_follow_local_keep(tmp_path):
    local = LocalObjectStore(tmp_path / "tier", create=True)

    def hold(step: int, data: bytes) -> str:  # a replica of rank 0's pack of ``step`` (a DCP save's)
        name = pack_name(f"{step:032x}")
        local.put_if_absent(name, data)
        local.put_if_absent(replicas_name(step, 0), json.dumps({name: len(data)}).encode())
        return name

    older = hold(5, b"five")
    prune(local, keep=1)
    assert local.exists(older)  # the newest step this tier knows of: kept
    newer = hold(6, b"six")
    prune(local, keep=1)
    assert local.exists(newer) and not local.exists(older) and not local.exists(replicas_name(5, 0))


def _replicate_planted(rank: int, port: int, root: str, queue) -> None:
    """One of two ranks (one node each): rank 1's tier holds a pack whose bytes are not what
    its name says (its index changed after the key was taken) and sends it as its share."""
    import torch.distributed as dist

    from ckptstore.tier.replicas import replicate

    os.environ["CKPTSTORE_PEER_TIMEOUT"] = "5"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    local = LocalObjectStore(Path(root) / f"tier{rank}", create=True)
    share = {}
    if rank == 1:
        key, parts, _ = pack.encode_parts([("w", "fp32", 0, torch.arange(8.0))])
        data = b"".join(bytes(part) for part in parts).replace(b'"w"', b'"v"')  # another tensor's name
        local.put_if_absent(pack_name(key), data)
        share = {pack_name(key): len(data)}
    try:
        replicate(local, 5, rank, share, Peers([1 - rank], [1 - rank]), dist.group.WORLD)
        outcome = "replicated"
    except Exception as exc:  # noqa: BLE001 - what each rank saw goes back to the test
        outcome = f"{type(exc).__name__}: {exc}"
    tier = Path(root) / f"tier{rank}"
    queue.put((rank, outcome, sorted(p.relative_to(tier).as_posix() for p in tier.rglob("*") if p.is_file())))
    dist.destroy_process_group()


def test_a_peers_object_that_does_not_hash_to_its_name_is_not_kept(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=_replicate_planted, args=(r, port, str(tmp_path), queue)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    seen = {rank: (outcome, names) for rank, outcome, names in (queue.get(timeout=300) for _ in procs)}
    for proc in procs:
        proc.join(60)
    outcome, names = seen[0]
    assert outcome.startswith(
        "CorruptError: rank 1 sent 1 objects of step 5 that are not what their names say"
    )
    assert not any(name.startswith(("packs/", "tier/replicas/")) for name in names), names
    assert seen[1][0] != "replicated"  # nobody said it was durable: the share is not marked
    assert "tier/replicated/000000000005/1" not in seen[1][1]
