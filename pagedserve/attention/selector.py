"""Choosing an attention backend by name and device (the backends are imported here, when
chosen: triton is optional)."""

from __future__ import annotations

from pagedserve.attention.backend import AttentionBackend


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Pick a backend: ``cpu`` (C++ kernel reading the blocks directly), ``torch``
    (batched PyTorch), ``reference`` (per-sequence loop, the
    test oracle) or ``triton`` (paged-attention kernels; CUDA, or CPU under Triton's
    interpreter ``TRITON_INTERPRET=1``, for tests). ``auto`` is ``triton`` on CUDA when
    the ``triton`` package imports, ``cpu`` on CPU when the kernel builds, else ``torch``.

    Raises ``ValueError`` for an unknown name, or ``triton`` where it cannot run.
    """
    from pagedserve.attention.torch_attn import ReferenceAttention, TorchAttention

    names = ("cpu", "reference", "torch", "triton")
    if name == "auto":
        name = "torch"
        if str(device) == "cpu":
            from pagedserve.cpu_ops import cpu_ops_available

            name = "cpu" if cpu_ops_available() else "torch"
        if str(device).startswith("cuda"):
            try:
                _triton_backend(device)
                name = "triton"
            except ValueError:
                pass
    if name == "triton":
        return _triton_backend(device)
    if name == "cpu":
        from pagedserve.attention.cpu_attn import CpuAttention

        return CpuAttention()
    backends = {"reference": ReferenceAttention, "torch": TorchAttention}
    if name not in backends:
        raise ValueError(f"attention backend must be one of auto, {', '.join(names)}; got {name!r}")
    return backends[name]()


def _triton_backend(device: str) -> AttentionBackend:
    try:
        from pagedserve.attention import triton_attn
    except ImportError as e:
        raise ValueError(f"the triton attention backend needs the triton package ({e})") from e
    if not str(device).startswith("cuda") and not triton_attn.INTERPRET:
        raise ValueError("the triton attention backend runs on CUDA; on CPU only under "
                         "Triton's interpreter (TRITON_INTERPRET=1, slow: for tests)")
    return triton_attn.TritonAttention()
