"""Tensor parallelism over ``torch.distributed``: the pieces a worker uses to hold one
rank's shard. The executors that start and watch the ranks are in ``executor/``;
data-parallel replicas are in ``engine/``.

::

    config.py     ParallelConfig (vLLM's flags), checked once
    group.py      the process groups of one engine's ranks: collectives and commands
    sharding.py   Megatron-style sharding of the existing models (config, weights, layers)
"""
