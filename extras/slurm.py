"""srun without torchrun: each process's rank, the world's size and the rendezvous address from
Slurm's variables, where a script is started by srun directly (docs/launching.md). A script imports
it where SLURM_PROCID is set and RANK is not."""

from __future__ import annotations

import os
import re

from utils import UsageError


def set_ranks(port: int | None) -> None:
    """Under srun without torchrun: RANK, WORLD_SIZE and LOCAL_RANK from Slurm's variables, and
    MASTER_ADDR (the node list's first host) and MASTER_PORT (port, or 29500) unless set."""
    env = os.environ
    env.update(
        RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"]
    )
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    env.setdefault("MASTER_ADDR", slurm_master_addr(nodelist))
    env.setdefault("MASTER_PORT", str(port or 29500))


def slurm_master_addr(nodelist: str) -> str:
    """First host of a Slurm node list, compressed or not: 'node[01-04],gpu7' -> 'node01'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read a host from Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()  # node, 01-04
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
