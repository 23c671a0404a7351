"""Quantization methods: how a model's linear layers hold their weights and multiply by
them (``base.py`` says what a method is).

::

    base.py         Linear, LinearWeight, QuantizationMethod, LoadContext
    none.py         float weights (GGUF dequantized at load): the exact path; fixed-order GEMM
    gguf.py         GGUF Q4_1 / Q8_0 / MXFP4 / NVFP4 blocks with 8-bit activations (CPU)
    fp4_formats.py  MXFP4 and NVFP4: quantize, dequantize, the block kernel's bytes
    fp4.py          FP4 weights (MXFP4, NVFP4), from the file or quantized at load
    fp4_triton.py   FP4 weights on CUDA: a Triton GEMM decoding the blocks
    int8.py         W8A8 int8 rows, per-token activation scales (CPU)
    smoothquant.py  int8's calibration: activation outliers moved into the weights

The registry below is the one place that knows the ``--quantization`` names.
"""

from __future__ import annotations

import logging
import pathlib

from pagedserve.cpu_ops import cpu_ops_available
from pagedserve.quantization.base import QuantizationMethod
from pagedserve.quantization.fp4 import MXFP4Method, NVFP4Method
from pagedserve.quantization.gguf import GGUFMethod
from pagedserve.quantization.int8 import Int8Method
from pagedserve.quantization.none import NoneMethod

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {
    "gguf": GGUFMethod,
    "int8": Int8Method,
    "mxfp4": MXFP4Method,
    "none": NoneMethod,
    "nvfp4": NVFP4Method,
}
QUANTIZATION_CHOICES = tuple(QUANTIZATION_METHODS)


def get_quantization_method(name: str | None, model_path: pathlib.Path, device: str,
                            tensor_parallel_size: int = 1) -> QuantizationMethod:
    """The method for ``--quantization name`` (None: the default) on this model and device.

    The default is ``gguf`` for a .gguf model on CPU where the C++ kernels build, with one
    rank (the block kernels read whole rows), else ``none``; ``gguf`` asked for on another
    device or with tensor parallelism falls back to ``none`` (logged).

    Raises ValueError for a name not in ``QUANTIZATION_CHOICES``, ``gguf`` for a model that
    is not a GGUF file, a CPU-only method (int8) on another device, or an FP4 method where
    the C++ kernels (its quantizer) did not build.
    """
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} or "
                         f"unset; got {name!r}")
    is_gguf = pathlib.Path(model_path).suffix.lower() == ".gguf"
    if name == "gguf" and not is_gguf:
        raise ValueError(f"quantization 'gguf' needs a .gguf model; got {str(model_path)!r}")
    method = QUANTIZATION_METHODS.get(name)
    if method is not None and method.cpu_only and device != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only; got device {device!r}")
    if method is not None and method.needs_cpu_ops and not cpu_ops_available():
        raise ValueError(f"quantization {name!r} needs the C++ CPU kernels, which did not "
                         "build here (see the log)")
    if name is None:
        name = "gguf" if is_gguf else "none"
    if name == "gguf" and device != "cpu":
        logger.info("GGUF kernels run on CPU only: %s uses dequantized weights", device)
        name = "none"
    if name == "gguf" and (tensor_parallel_size > 1 or not cpu_ops_available()):
        name = "none"
    return QUANTIZATION_METHODS[name]()
