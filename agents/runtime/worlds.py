"""The process groups a job's ranks form, on a TCPStore at a rendezvous: the backend, the
store (rank 0 serves it, the others connect), and the worlds made on it. A switch runs on
the union world, where process p is rank p; when the plan's device map gives ranks other
processes, the ranks then form the new layout's world under their new numbers, on the same
store (rank 0 stays process 0, so the store's server stays where it is)."""
from __future__ import annotations

import datetime


def backend() -> str:
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def rendezvous_store(address: str, master: bool, timeout: float):
    """The TCPStore at `address` (host:port): served by the master (rank 0), which listens on
    every interface; the others connect, retrying until it is there or `timeout` passes."""
    import torch.distributed as dist

    host, port = split(address)
    return dist.TCPStore("0.0.0.0" if master else host, port, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def join_world(store, prefix: str, rank: int, world: int, timeout: float) -> None:
    """Form the default process group `prefix` on `store` as `rank` of `world`."""
    import torch.distributed as dist

    dist.init_process_group(backend(), store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def renumbered_world(store, prefix: str, rank: int | None, world: int, timeout: float) -> bool:
    """Leave the union world and form the new layout's world as `rank` (its number under
    the device map). False: this process takes no rank (it leaves the job)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    if rank is None:
        return False
    join_world(store, prefix, rank, world, timeout)
    return True
