"""Distributed inference: tensor parallel ranks (``uni``, ``mp`` and ``ray`` executors over
``torch.distributed``) and data-parallel engine replicas.

::

    config.py     ParallelConfig (vLLM's flags), checked once
    group.py      the process groups of one engine's ranks: collectives and commands
    sharding.py   Megatron-style sharding of the existing models (config, weights, layers)
    worker.py     a non-driver rank: builds its shard, then runs the driver's commands
    executor.py   starts and watches the ranks (uni, mp processes); the driver's model
    ray_executor.py   the ranks as Ray actors (placement group, one bundle per rank)
    data_parallel.py  data-parallel replicas (processes or Ray actors) behind one server,
                      and the request router
    replica.py    one replica: an AsyncLLM serving the server's messages
"""
