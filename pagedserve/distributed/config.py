"""``ParallelConfig``: how an engine is spread over ranks and replicas (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Attributes:
        tensor_parallel_size: ranks one model is split over (>= 1).
        data_parallel_size: engine replicas behind one server (>= 1).
        distributed_executor_backend: ``uni`` (one rank, in this process), ``mp`` (processes
            on this machine) or ``ray`` (Ray actors); None picks ``uni`` for one rank and
            ``mp`` for more, as vLLM does.
        distributed_timeout: seconds one collective may wait for a rank before the engine
            declares the rank hung (> 0).

    Raises ``ValueError`` naming the field for a bad value.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1; got {self.data_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}"
                             f"; got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank; "
                             f"tensor_parallel_size is {self.tensor_parallel_size} (use mp or ray)")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds; got {self.distributed_timeout}")

    @property
    def backend(self) -> str:
        """The executor backend, with the default resolved."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @classmethod
    def from_engine_args(cls, args) -> ParallelConfig:
        return cls(args.tensor_parallel_size, args.data_parallel_size,
                   args.distributed_executor_backend, args.distributed_timeout)

    def check_engine(self, cache, device: str) -> None:
        """Refuse what one engine with these ranks does not do (``ValueError``, naming the
        flag): data-parallel replicas (they run behind the server, one engine each), and a
        KV cache sized by a profiling pass under tensor parallelism. ``cache``: the
        engine's ``CacheConfig``."""
        if self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs replicas of this engine behind "
                             "`pagedserve serve`; one LLMEngine is one replica")
        if self.tensor_parallel_size == 1:
            return
        needs_profile = (cache.num_gpu_blocks_override is None
                         and cache.kv_cache_memory_bytes is None)
        if needs_profile and (cache.gpu_memory_utilization is not None or device != "cpu"):
            raise ValueError("tensor_parallel_size > 1 sizes the KV cache without a "
                             "profiling pass: give --kv-cache-memory-bytes (per rank) or "
                             "--num-gpu-blocks-override instead of "
                             "--gpu-memory-utilization")
