"""Rendezvous detection from each launcher's variables, host identity and local layout."""

from __future__ import annotations

import importlib.util

import pytest

from ddlcore import topology
from ddlcore.errors import RendezvousError
from ddlcore.job.rendezvous import detect, resolve_master
from tests.harness import free_port, require


def test_ddlrun_variables():
    info = detect(
        {
            "DDL_RANK": "2",
            "DDL_SIZE": "4",
            "DDL_MASTER_ADDR": "10.0.0.1",
            "DDL_MASTER_PORT": "29500",
            "DDL_LOCAL_RANK": "0",
            "DDL_LOCAL_SIZE": "2",
        }
    )
    assert (info.rank, info.size, info.master_addr, info.master_port) == (2, 4, "10.0.0.1", 29500)
    assert (info.source, info.local_rank, info.local_size) == ("ddlrun", 0, 2)


def test_torchrun_variables():
    info = detect(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "1234",
        }
    )
    assert (info.rank, info.size, info.master_addr, info.master_port, info.source) == (
        1,
        2,
        "h0",
        1234,
        "torchrun",
    )


def test_mpich_variables_need_a_broadcast_address():
    info = detect(
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    )
    assert (info.rank, info.size, info.master_addr, info.source) == (3, 4, None, "mpich")
    assert (info.local_rank, info.local_size) == (1, 2)


def test_openmpi_and_slurm_variables():
    assert detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"}).source == "openmpi"
    assert detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}).rank == 5


def test_explicit_master_beats_mpi_broadcast():
    info = detect(
        {
            "PMI_RANK": "0",
            "PMI_SIZE": "2",
            "DDL_MASTER_ADDR": "127.0.0.1",
            "DDL_MASTER_PORT": "5000",
        }
    )
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 5000)
    assert resolve_master(info, {}) is info


def test_no_launcher_is_a_world_of_one():
    info = detect({})
    assert (info.rank, info.size) == (0, 1)


def test_rank_not_below_size_is_rejected():
    with pytest.raises(ValueError, match="DDL_RANK"):
        detect({"DDL_RANK": "4", "DDL_SIZE": "4"})


def test_torchrun_without_master_is_an_error():
    info = detect({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RendezvousError, match="MASTER_ADDR"):
        resolve_master(info, {})


def test_host_identity_includes_network_namespace():
    ident = topology.host_identity({})
    assert "/netns:" in ident
    assert topology.host_identity({"DDL_HOST_ID": "rack1-node7"}) == "rack1-node7"


def test_layout_numbers_local_ranks_per_host():
    hosts = ["a", "b", "a", "b", "a"]
    lay = topology.layout(hosts, 4)
    assert (lay.local_rank, lay.local_size, lay.nhosts) == (2, 3, 2)
    assert lay.host_of == (0, 1, 0, 1, 0)
    assert lay.ranks_per_host == (3, 2)


_TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1234",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_torchrun_agent_store_is_torchs_not_ours():
    info = detect(_TORCHRUN)
    assert info.torch_store and (info.master_addr, info.master_port) == ("127.0.0.1", 1234)
    # Imitated variables (no agent): MASTER_PORT is where rank 0 serves, as before.
    assert not detect({**_TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}).torch_store


def test_ddl_master_port_wins_over_torchs():
    info = detect({**_TORCHRUN, "DDL_MASTER_PORT": "5000"})
    assert (info.master_addr, info.master_port, info.torch_store) == ("127.0.0.1", 5000, False)
    info = detect(
        {
            "DDL_RANK": "0",
            "DDL_SIZE": "2",
            "DDL_MASTER_ADDR": "10.0.0.1",
            "DDL_MASTER_PORT": "5000",
            "MASTER_ADDR": "10.0.0.2",
            "MASTER_PORT": "6000",
        }
    )
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 5000)


def _torch_distributed():
    require(
        importlib.util.find_spec("torch") is not None,
        "torch is not installed (pip install 'ddlcore[torch]')",
    )
    import torch.distributed as dist

    return dist


def _torch_store():
    from datetime import timedelta

    dist = _torch_distributed()
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5)), port


def test_rank0_publishes_its_store_in_torchruns_and_the_others_read_it():
    server, port = _torch_store()
    env = {**_TORCHRUN, "MASTER_PORT": str(port)}
    env0 = {**env, "RANK": "0", "LOCAL_RANK": "0"}
    rank0 = resolve_master(detect(env0), env0, 5.0)
    assert rank0.master_addr == "127.0.0.1" and rank0.master_port not in (None, port)
    assert not rank0.torch_store
    assert server.get("ddlcore/job7/0/store") == f"127.0.0.1:{rank0.master_port}".encode()
    rank1 = resolve_master(detect(env), env, 5.0)
    assert (rank1.master_addr, rank1.master_port) == (rank0.master_addr, rank0.master_port)
    # Another init in rank 0's process serves the same store: the same address again.
    again = resolve_master(detect(env0), env0, 5.0)
    assert again.master_port == rank0.master_port
    # After a restart, the last attempt's address is not read.
    with pytest.raises(RendezvousError, match="rank 0 did not publish"):
        restarted = {**env, "TORCHELASTIC_RESTART_COUNT": "1"}
        resolve_master(detect(restarted), restarted, 0.5)


def test_torchrun_store_unreachable_is_a_rendezvous_error():
    _torch_distributed()
    env = {**_TORCHRUN, "MASTER_PORT": str(free_port())}
    with pytest.raises(RendezvousError, match="cannot reach torchrun's store"):
        resolve_master(detect(env), env, 0.5)
