"""The process groups of one engine's tensor-parallel ranks (rank 0 is the driver).

Two gloo groups over one ``TCPStore`` that the driver hosts:

- ``compute``: the model's collectives (all-reduce after the row-parallel layers and the
  vocabulary-parallel embedding, the logits gather). Its timeout is
  ``--distributed-timeout``: a rank that does not take part within it is hung, and the
  collective raises on the others. On CUDA it is NCCL.
- ``control``: the driver's commands to the other ranks (one pickled object, broadcast from
  rank 0). The others wait on it without a practical limit, because an idle server sends
  nothing for hours; the driver's sends time out like the compute group's collectives.

A rank that dies closes its sockets, so a collective waiting on it fails at once.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# How long ranks wait for each other's commands: an idle engine sends none.
CONTROL_TIMEOUT = datetime.timedelta(days=7)
# How long the ranks may take to start and join (processes or Ray actors start slowly on a
# loaded machine; a rank that dies meanwhile fails the start at once).
STARTUP_TIMEOUT = 600.0


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_ranks(store: dist.TCPStore, world_size: int, timeout: float,
                    check_ranks: Callable[[], None] | None) -> None:
    keys = [f"joined/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if check_ranks is not None:
            check_ranks()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tensor-parallel ranks did not all join within {timeout:g} s")
        time.sleep(0.05)


class RankGroup:
    """One rank's view of the engine's ranks.

    Args:
        rank: this rank, 0 (the driver, which hosts the store) to ``world_size - 1``.
        world_size: number of ranks.
        host, port: address of the driver's ``TCPStore``.
        timeout: seconds a collective may wait (``--distributed-timeout``); joining may
            take ``max(timeout, STARTUP_TIMEOUT)``.
        device: ``cpu`` (gloo) or a CUDA device (NCCL for the compute group).

        check_ranks: the driver's check, called while it waits for the others to join,
            that raises if one has already failed (so a rank that dies at start-up fails
            the start at once, not after ``timeout``).

    Blocks until every rank has joined; raises ``RuntimeError`` when they do not within
    ``timeout``, or what ``check_ranks`` raises.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 device: str = "cpu", check_ranks: Callable[[], None] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        wait = self.timeout = datetime.timedelta(seconds=timeout)
        startup = max(timeout, STARTUP_TIMEOUT)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=startup))
        if rank == 0:
            _wait_for_ranks(self.store, world_size, startup, check_ranks)
        else:
            self.store.set(f"joined/{rank}", "1")
        prefix = dist.PrefixStore
        if device.startswith("cuda"):
            self.compute = dist.ProcessGroupNCCL(prefix("compute", self.store), rank, world_size)
        else:
            self.compute = dist.ProcessGroupGloo(prefix("compute", self.store), rank,
                                                 world_size, wait)
        self.control = dist.ProcessGroupGloo(prefix("control", self.store), rank, world_size,
                                             CONTROL_TIMEOUT)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.compute.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        """The minimum of an integer over the ranks (on the control group: ranks may
        reach it at different times, e.g. after loading their shards)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` ``[..., n]`` concatenated in rank order along the last
        dimension ``[..., world_size * n]``; other ranks: None."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self.compute.gather([], [x], opts).wait()
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.compute.gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)

    def send_command(self, command: tuple) -> None:
        """Driver: broadcast one picklable command to the other ranks."""
        data = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        self._broadcast(data)

    def recv_command(self) -> tuple:
        """Other ranks: wait for the driver's next command."""
        size = torch.empty(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.is_driver:  # gloo's root waits for the others: a hung one must not hang it
            opts.timeout = self.timeout
        self.control.broadcast([t], opts).wait()
