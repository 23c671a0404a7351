"""SmoothQuant for ``--quantization int8`` (and FP4's): move activation outliers into the
weights.

Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models" (arXiv:2211.10438), eq. 4: for ``y = x @ W.T`` with ``x [T, K]``, per input
channel ``j`` take ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` and compute
``y = (x / s) @ (W * s).T``, exact in float. A few channels of a transformer's activations
are ~100x larger than the rest, and per-token int8 spends its 255 steps on them; divided by
``s`` they shrink, and the weights, quantized per output row, absorb the factor.

The division costs nothing at run time where the activation comes out of something that can
take it:

- ``qkv_proj`` and ``gate_up_proj`` read the output of an RMSNorm whose weight multiplies
  each channel: the norm's weight is divided by ``s``;
- ``down_proj`` reads ``act(gate) * up``: the ``up`` rows of ``gate_up_proj`` are divided
  by ``s``.

``max|x_j|`` comes from a few prefills of ``CALIBRATION_CHATS`` (our own text, in the
model's chat format; 891 tokens, 2 s at load here) before quantization. Measured on
SmolLM2-135M (perplexity of the MT-Bench reference answers, ``benchmarks/README.md``):
every Linear and the LM head in int8 went from +2.64% over float32 to +0.94% (+0.75% to
+1.27% when calibrated on 40 or 4 ShareGPT texts instead). The scales follow the float
sums of the calibration to their last bits, so the int8 model can differ slightly with
the number of threads it was loaded with (as float results do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Migration strength (the paper's alpha) for the norm-fed projections and for down_proj.
# Tried on SmolLM2-135M (benchmarks/README.md): norms at 0.3 / 0.5 / 0.7 / 0.8 with
# down_proj float (+0.67% / +0.77% / +0.32% / +0.74%), and every Linear in int8 with norms
# at 0.7 and down_proj at 0.5 (+0.75%) or not smoothed (+0.85%).
NORM_ALPHA = 0.7
DOWN_ALPHA = 0.5

# (user, assistant) turns in several registers: conversation, explanation, lists, numbers,
# code. Written for this file; not drawn from any benchmark set.
CALIBRATION_CHATS = [
    ("Hi! Can you help me plan a weekend trip?",
     ("Of course! Tell me where you are starting from, how far you are happy to travel, and "
      "what you enjoy: hiking, museums, food, or simply resting somewhere quiet. With that I "
      "can suggest a place, a rough schedule for Saturday and Sunday, and what to pack.")),
    ("Why do leaves change color in autumn?",
     ("Leaves are green because of chlorophyll, which captures sunlight for photosynthesis. "
      "As days shorten and nights grow cold, trees stop making chlorophyll and break it down. "
      "The yellow and orange pigments, carotenoids, were there all summer and now show "
      "through, while some trees also produce red anthocyanins from sugars trapped in the "
      "leaf.")),
    ("List five tips for better sleep.",
     ("1. Go to bed and wake up at the same time every day.\n2. Keep the bedroom dark, quiet "
      "and cool.\n3. Avoid caffeine after midday and heavy meals late at night.\n4. Put "
      "screens away half an hour before bed.\n5. If you cannot sleep after twenty minutes, "
      "get up and read until you feel tired.")),
    ("What is 15% of 240, and how do you work it out?",
     ("15% of 240 is 36. Ten percent of 240 is 24, five percent is half of that, 12, and "
      "24 + 12 = 36. Equivalently, 240 x 0.15 = 36.")),
    ("Write a Python function that returns the n-th Fibonacci number.",
     ("Here is an iterative version, which runs in linear time and constant memory:\n\n"
      "```python\ndef fibonacci(n: int) -> int:\n    if n < 0:\n        raise ValueError(\"n "
      "must be non-negative\")\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + "
      "b\n    return a\n```\n\nFor example, `fibonacci(10)` returns 55.")),
    ("Summarize the causes of the French Revolution in a short paragraph.",
     ("By the late 1780s France was deeply in debt after costly wars, and its tax system "
      "spared the nobility and clergy while burdening ordinary people. Poor harvests drove "
      "up the price of bread, Enlightenment ideas questioned the authority of the king, and "
      "when Louis XVI called the Estates-General in 1789 to raise money, the Third Estate "
      "declared itself a National Assembly, setting the revolution in motion.")),
    ("Translate into French and Spanish: 'The library opens at nine tomorrow.'",
     ("French: « La bibliothèque ouvre à neuf heures demain. »\nSpanish: «La biblioteca abre "
      "a las nueve mañana.»")),
    ("Give me a JSON object describing a book.",
     ('{"title": "The Quiet Harbor", "author": "M. Linden", "year": 2019, "pages": 312, '
      '"genres": ["mystery", "coastal fiction"], "available": true}')),
]


def calibration_token_ids(tokenizer) -> list[list[int]]:
    """``CALIBRATION_CHATS`` as token ids, through the tokenizer's chat template when it
    has one (so the template's special tokens are calibrated too), else as plain text."""
    if getattr(tokenizer, "chat_template", None):
        return [list(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            tokenize=True, return_dict=False)) for q, a in CALIBRATION_CHATS]
    return [tokenizer.encode(f"{q}\n{a}") for q, a in CALIBRATION_CHATS]


def smoothable(model: nn.Module) -> bool:
    """True if every decoder layer is of the plain pre-norm kind whose norms can take the
    scales (the model's ``plain_pre_norm_layers``: Llama, Qwen2/3; not Gemma's offset norms
    or the sandwich layers)."""
    return model.plain_pre_norm_layers() is not None


def smooth_model(model: nn.Module, token_ids: list[list[int]],
                 prefill: Callable[[list[int]], object], norm_alpha: float = NORM_ALPHA,
                 down_alpha: float = DOWN_ALPHA) -> int:
    """Calibrate on ``token_ids`` (``prefill(ids)`` runs ``model`` over one prompt) and
    fold SmoothQuant scales (migration strength ``norm_alpha`` for the norm-fed
    projections, ``down_alpha`` for down_proj) into every decoder layer; call before
    quantizing. Returns the number of layers smoothed. Raises ``ValueError`` if not
    ``smoothable(model)``."""
    layers = model.plain_pre_norm_layers()
    if layers is None:
        raise ValueError("SmoothQuant needs plain pre-norm decoder layers (LlamaDecoderLayer "
                         "with RMSNorm)")
    inputs = [p for layer in layers for p in (layer.self_attn.qkv_proj,
                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    absmax = _input_absmax(token_ids, prefill, inputs)
    with torch.no_grad():
        for layer in layers:
            mlp = layer.mlp
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, mlp.gate_up_proj)):
                s = _scales(absmax[proj], proj.weight, norm_alpha)
                _scale_(norm.weight, 1 / s)
                _scale_(proj.weight, s)
            s = _scales(absmax[mlp.down_proj], mlp.down_proj.weight, down_alpha)
            inter = mlp.down_proj.weight.shape[1]
            _scale_(mlp.gate_up_proj.weight[inter:], 1 / s[:, None])  # the up rows
            _scale_(mlp.down_proj.weight, s)
    return len(layers)


def _scales(absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s [K]`` (float32) for ``weight [N, K]`` whose input's channel maxima
    are ``absmax [K]`` (eq. 4); channels never seen nonzero keep ``s = 1``."""
    w_max = weight.detach().abs().amax(0).float().clamp(min=1e-5)
    s = absmax.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return torch.where(absmax > 0, s, torch.ones_like(s))


def _scale_(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    """``tensor *= factor`` (broadcast), computed in float32 whatever the tensor's dtype."""
    tensor.copy_(tensor.float() * factor)


def _input_absmax(token_ids: list[list[int]], prefill: Callable[[list[int]], object],
                  modules: list[nn.Module]) -> dict[nn.Module, torch.Tensor]:
    """Per input channel, the largest |activation| each of ``modules`` sees over prefills
    of ``token_ids`` (float32 ``[K]`` each)."""
    absmax: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach()
        seen = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        absmax[module] = torch.maximum(absmax[module], seen) if module in absmax else seen

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        for ids in token_ids:
            prefill(ids)
    finally:
        for h in hooks:
            h.remove()
    return absmax
