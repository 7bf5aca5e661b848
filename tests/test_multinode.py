"""Two hosts on one machine: network namespaces joined by a veth pair. Each host
runs one node of the job, so rendezvous and gradients really cross a network."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from processes import PYTHON, TINY, free_port, max_weight_difference, metrics, run_parallel

SUBNET = "10.231.7"  # private addresses that exist only inside these test namespaces


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """[(namespace, address, interface)] for host 0 and host 1; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip) to create network namespaces")
    tag = os.getpid() % 100_000
    hosts = [(f"ddp{tag}n{i}", f"{SUBNET}.{i + 1}", f"ve{tag}n{i}") for i in (0, 1)]
    try:
        for namespace, _, _ in hosts:
            ip("netns", "add", namespace)
        ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for namespace, address, interface in hosts:
            ip("link", "set", interface, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:  # deleting a namespace deletes its end of the veth
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def on_host(host, *cmd) -> tuple[list, dict]:
    namespace, _, interface = host
    # gloo must use the link between the hosts, not the loopback device
    return ["ip", "netns", "exec", namespace, PYTHON, *cmd], {"GLOO_SOCKET_IFNAME": interface}


def test_torchrun_across_two_hosts(two_hosts, tmp_path, reference):
    out, port, master = tmp_path / "out", free_port(), two_hosts[0][1]
    run_parallel([on_host(host, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}",
                          "--nproc_per_node=1", f"--master_addr={master}", f"--master_port={port}",
                          "distributed.py", *TINY, "--no-augment", "--output-dir", out)
                  for i, host in enumerate(two_hosts)])
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5


def test_spawn_across_two_hosts(two_hosts, tmp_path, reference):
    out, port, master = tmp_path / "out", free_port(), two_hosts[0][1]
    run_parallel([on_host(host, "distributed_mp.py", *TINY, "--no-augment", "--nodes", "2",
                          "--node-rank", str(i), "--nproc", "1", "--ip", master, "--port", port,
                          "--output-dir", out)
                  for i, host in enumerate(two_hosts)])
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5
