"""The ``ray`` executor: tensor-parallel ranks 1.. as Ray actors, possibly on other machines.

The cluster is found as ``ray.init()`` finds it (``RAY_ADDRESS``, else a cluster started
with ``ray start`` on this machine); with none, a local Ray instance starts, as vLLM's
does, declaring at least one logical CPU per rank (as the ``mp`` backend, it runs 3 ranks
on 2 cores; Ray alone would declare the cores). One placement group holds a ``{"CPU": 1}``
bundle per rank (strategy ``PACK``: as few machines as the free CPUs allow); the bundle
on the driver's node is rank 0's (this process), the others get one actor each. The ranks
then meet over ``torch.distributed`` at the driver's node IP; Ray only places, starts and
watches them.

A cluster with fewer CPUs in all than ranks fails at once (``RuntimeError`` with both
numbers); one with enough CPUs, too few of them free, waits up to ``STARTUP_TIMEOUT`` s
for them (logged with the numbers).
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib

from pagedserve.distributed.group import STARTUP_TIMEOUT
from pagedserve.executor.multiproc import DistributedExecutor
from pagedserve.worker.worker import run_worker

logger = logging.getLogger(__name__)

# The pagedserve package this module belongs to (a checkout, or site-packages).
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


class RankActor:
    """A Ray actor holding one tensor-parallel rank (``run`` blocks until shutdown)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def package_file(self) -> str:
        """Where this actor imported pagedserve from (it must be the driver's copy)."""
        return str(PACKAGE_DIR / "__init__.py")

    def run(self, rank: int, world_size: int, host: str, port: int, args, ranks_here: int):
        run_worker(rank, world_size, host, port, args, ranks_here)


def actor_runtime_env() -> dict:
    """Actors import pagedserve from where the driver did (a checkout, or site-packages)."""
    root = str(PACKAGE_DIR.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def init_ray(num_ranks: int) -> None:
    """Connect to the Ray cluster as ``ray.init()`` would, or start a local one declaring
    ``max(cores, num_ranks)`` logical CPUs; nothing if Ray is initialized already."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=actor_runtime_env())
        return
    try:  # a cluster started with `ray start` on this machine
        ray.init(address="auto", runtime_env=actor_runtime_env())
    except ConnectionError:
        cpus = max(len(os.sched_getaffinity(0)), num_ranks)
        logger.info("starting a local Ray instance with %d logical CPUs", cpus)
        ray.init(num_cpus=cpus, runtime_env=actor_runtime_env())


def check_cpus(num_ranks: int) -> None:
    """Raise ``RuntimeError`` at once if the Ray cluster has fewer CPUs than ranks (its
    placement group could never be placed); log when too few are free now (it waits)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    free = ray.available_resources().get("CPU", 0)
    if total < num_ranks:
        raise RuntimeError(f"{num_ranks} tensor-parallel ranks need {num_ranks} CPUs of the "
                           f"Ray cluster (one each); it has {total:g} ({free:g} free): start "
                           "its nodes with more --num-cpus, or use fewer ranks")
    if free < num_ranks:
        logger.warning("the Ray cluster has %g of its %g CPUs free; %d ranks need %d: "
                       "waiting up to %g s", free, total, num_ranks, num_ranks, STARTUP_TIMEOUT)


class RayExecutor(DistributedExecutor):
    """Ranks 1.. as Ray actors. ``rank_nodes[r]`` is the Ray node id of rank r.

    Raises ``RuntimeError`` at once when the cluster has fewer CPUs than ranks, and when
    the placement group cannot be placed within ``STARTUP_TIMEOUT`` s or has no bundle on
    the driver's node."""

    def _host(self) -> str:
        import ray

        init_ray(self.world_size)
        return ray.util.get_node_ip_address()

    def _start_ranks(self, host: str, port: int) -> int:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_cpus(self.world_size)
        self.pg = placement_group([{"CPU": 1}] * self.world_size, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=STARTUP_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray could not place {self.world_size} ranks of 1 CPU each "
                               f"within {STARTUP_TIMEOUT:g} s (ray status shows the cluster's "
                               "free CPUs)") from None
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        driver_node = ray.get_runtime_context().get_node_id()
        mine = next((b for b in sorted(nodes) if nodes[b] == driver_node), None)
        if mine is None:
            raise RuntimeError("the placement group has no bundle on the driver's node: rank 0 "
                               "runs in this process and needs a CPU here")
        others = [b for b in sorted(nodes) if b != mine]
        self.rank_nodes = [driver_node] + [nodes[b] for b in others]
        per_node = collections.Counter(self.rank_nodes)
        # two threads: `run` blocks one for the rank's lifetime; the other answers queries
        actor_cls = ray.remote(num_cpus=1, max_concurrency=2)(RankActor)
        self.actors = [
            actor_cls.options(runtime_env=actor_runtime_env(), name=None,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  self.pg, placement_group_bundle_index=b)).remote()
            for b in others
        ]
        self.run_refs = [
            actor.run.remote(rank, self.world_size, host, port, self.args,
                             per_node[self.rank_nodes[rank]])
            for rank, actor in enumerate(self.actors, start=1)
        ]
        logger.info("Ray placed %d ranks on %d nodes", self.world_size, len(per_node))
        return per_node[driver_node]

    def _ended(self, timeout: float | None) -> str | None:
        import ray

        ready, _ = ray.wait(self.run_refs, num_returns=1, timeout=timeout)
        if not ready:
            return None
        rank = self.run_refs.index(ready[0]) + 1
        try:
            ray.get(ready[0])
            what = "returned"
        except Exception as err:  # noqa: BLE001 - the actor's error or death, reported
            what = f"failed: {err}"
        return f"tensor-parallel rank {rank} (Ray node {self.rank_nodes[rank]}) {what}"

    def _wait_for_exit(self) -> str:
        return self._ended(timeout=None)

    def _check_started(self) -> None:
        what = self._ended(timeout=0)
        if what is not None:
            raise RuntimeError(f"{what} while starting")

    def _stop_ranks(self, told: bool) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if told:
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=10)
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if hasattr(self, "pg"):
            remove_placement_group(self.pg)
