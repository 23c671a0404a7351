"""Distributed inference: tensor parallel ranks (``uni``, ``mp`` and ``ray`` executors over
``torch.distributed``) and data-parallel engine replicas.

::

    config.py     ParallelConfig (vLLM's flags), checked once
    group.py      the process groups of one engine's ranks: collectives and commands
    sharding.py   Megatron-style sharding of the existing models (config, weights, layers)
    worker.py     a non-driver rank: builds its shard, then runs the driver's commands
    executor.py   starts and watches the ranks (mp processes or Ray actors); driver model
    data_parallel.py  data-parallel replicas behind one server, and the request router
"""
