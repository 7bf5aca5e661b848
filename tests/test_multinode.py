"""Two hosts on one machine: network namespaces joined by a veth pair. Each host
runs one node of the job, so rendezvous and gradients really cross a network."""

from __future__ import annotations

import pytest

from processes import (
    TINY,
    can_make_hosts,
    free_port,
    max_weight_difference,
    metrics,
    on_host,
    run_parallel,
    two_hosts,
)

# the launch itself is under test: every script starts as users start it
pytestmark = pytest.mark.real_launch


@pytest.fixture(name="two_hosts")
def two_hosts_fixture():
    """[(namespace, address, interface)] for host 0 and host 1; removed afterwards."""
    if not can_make_hosts():
        pytest.skip("needs root and iproute2 (ip) to create network namespaces")
    with two_hosts() as hosts:
        yield hosts


def test_torchrun_across_two_hosts(two_hosts, tmp_path, reference):
    out, port, master = tmp_path / "out", free_port(), two_hosts[0][1]
    run_parallel(
        [
            on_host(
                host,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={i}",
                "--nproc_per_node=1",
                f"--master_addr={master}",
                f"--master_port={port}",
                "distributed.py",
                *TINY,
                "--no-augment",
                "--output-dir",
                out,
            )
            for i, host in enumerate(two_hosts)
        ]
    )
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5


def test_spawn_across_two_hosts(two_hosts, tmp_path, reference):
    out, port, master = tmp_path / "out", free_port(), two_hosts[0][1]
    run_parallel(
        [
            on_host(
                host,
                "distributed_mp.py",
                *TINY,
                "--no-augment",
                "--nodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc",
                "1",
                "--ip",
                master,
                "--port",
                port,
                "--output-dir",
                out,
            )
            for i, host in enumerate(two_hosts)
        ]
    )
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5
