"""Drafting with a model (speculative decoding's ``self`` and ``draft_model`` methods): a
second model in the worker whose KV lives in the same pool, indexed by the same block
tables as the target's.

- ``self``: the draft is the target's own weights through a fast inexact quantization
  method (GGUF blocks with 8-bit activations, or int8) and writes into the TARGET's KV
  cache: the K/V of every verified token there is exact, and the slots it writes ahead are
  overwritten by the next verify pass, so it needs no cache of its own.
- ``draft_model``: a smaller model of the same vocabulary with a cache of its own,
  ``[num_blocks, ...]`` like the target's so that one block id addresses both (vLLM's
  layout for draft layers). It first runs the step's own tokens (prompt chunks and verified
  tokens alike) to keep its cache level with the target's.

Then, per request that sampled, k one-row steps: feed the newest token, draft the next.
A greedy request drafts the argmax (one-hot); a sampling request samples from the draft's
distribution ``q`` with the target's sampling parameters, and keeps ``q`` for the rejection
sampler (``spec_decode/rejection.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from torch import nn

from pagedserve.args import EngineArgs
from pagedserve.attention import AttentionBackend
from pagedserve.config import SpeculativeConfig
from pagedserve.model_loader.model_config import ModelConfig
from pagedserve.quantization import get_quantization_method
from pagedserve.request import Request
from pagedserve.sample.sampler import Sampler, SamplingBatch
from pagedserve.spec_decode.drafter import Drafter, NgramDrafter, max_drafts
from pagedserve.spec_decode.rejection import sample_draft
from pagedserve.worker.model_loader import load_model


class ModelDrafter:
    """Args:
        model: the draft model (built and loaded by the worker).
        k: ``num_speculative_tokens``.
        max_model_len, vocab_size, eos_token_id: the target's.
        kv_caches: the draft's own KV cache (``draft_model``), or None to write into the
            target's (``self``).
    """

    def __init__(self, model: nn.Module, k: int, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None, kv_caches: list[torch.Tensor] | None = None) -> None:
        self.model, self.k = model, k
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.eos_token_id = eos_token_id
        self.kv_caches = kv_caches
        self.probs: dict[str, torch.Tensor] = {}  # request id -> [num_drafts, V] q

    def after_forward(self, runner, step: tuple) -> None:
        """Every step: a draft model with a cache of its own runs the step's tokens into
        it, so its K/V stay level with the target's (prefix-cache hits included)."""
        if self.kv_caches is not None:
            self.model(step[0], step[1], self.kv_caches, step[2])

    def propose(self, runner, step: tuple, requests: list[Request],
                sampled: dict[str, list[int]], block_tables: dict[str, list[int]]
                ) -> dict[str, list[int]]:
        caches = runner.kv_caches if self.kv_caches is None else self.kv_caches
        limits = {r.request_id: max_drafts(r, len(sampled[r.request_id]), self.k,
                                           self.max_model_len) for r in requests}
        active = [r for r in requests if limits[r.request_id] > 0]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in active}
        for i in range(max((limits[r.request_id] for r in active), default=0)):
            active = [r for r in active if limits[r.request_id] > i]
            last = [(sampled[r.request_id] + drafts[r.request_id])[-1] for r in active]
            starts = [r.num_tokens + len(sampled[r.request_id]) - 1 + i for r in active]
            input_ids, positions, meta = runner.prepare_inputs(
                [[t] for t in last], starts, [block_tables[r.request_id] for r in active])
            logits = self.model.compute_logits(self.model(input_ids, positions, caches, meta))
            history = [r.output_token_ids + sampled[r.request_id] + drafts[r.request_id]
                       for r in active]
            for r, token, q in zip(active, *self._draft(active, history, logits)):
                drafts[r.request_id].append(token)
                if q is not None:
                    probs[r.request_id].append(q)
        self.probs = {rid: torch.stack(qs) for rid, qs in probs.items() if qs}
        return {rid: d for rid, d in drafts.items() if d}

    def _draft(self, requests: list[Request], history: list[list[int]], logits: torch.Tensor
               ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row, and for a sampling row the distribution it came from."""
        batch = SamplingBatch.build([r.sampling_params for r in requests],
                                    [r.prompt_token_ids for r in requests], history,
                                    self.eos_token_id, self.vocab_size, logits.device)
        x = Sampler.process_logits(logits.float(), batch)
        tokens = x.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(requests)
        if not batch.all_greedy:
            probs = Sampler.sampling_logits(x, batch).softmax(-1)
            for j, r in enumerate(requests):
                if not r.sampling_params.is_greedy:
                    qs[j] = probs[j]
                    tokens[j] = sample_draft(probs[j], r.sampling_params.seed, len(history[j]))
        return tokens, qs

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        q = self.probs.get(request_id)
        return None if q is None or q.shape[0] < num_drafts else q[:num_drafts]


def build_drafter(spec: SpeculativeConfig, args: EngineArgs, target: ModelConfig,
                  backend: AttentionBackend, eos_token_id: int | None, tokenizer
                  ) -> tuple[Drafter, object | None]:
    """The drafter of ``spec`` for a target described by ``target``, and the config of the
    draft model's own KV cache (``draft_model``; None for the others).

    Raises ``ValueError`` naming the field: ``self`` where the target has no fast path,
    ``draft_model`` of another vocabulary size.
    """
    vocab = target.hf_config.vocab_size
    if spec.method == "ngram":
        return NgramDrafter(spec, target.max_model_len), None
    if spec.method == "self":
        quant = self_draft_quantization(spec, target.model_path, target.device)
        model = load_model(dataclasses.replace(args, quantization=quant), target.hf_config,
                           target.model_path, target.device, target.dtype, backend,
                           target.max_model_len, None, tokenizer)
        return ModelDrafter(model, spec.num_speculative_tokens, target.max_model_len, vocab,
                            eos_token_id), None
    draft_args = dataclasses.replace(args, model=spec.model, quantization=spec.quantization,
                                     max_model_len=target.max_model_len)
    draft = ModelConfig.from_args(draft_args, target.device)
    if draft.hf_config.vocab_size != vocab:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                         f"{draft.hf_config.vocab_size} tokens; the target's has {vocab}")
    model = load_model(draft_args, draft.hf_config, draft.model_path, draft.device,
                       target.dtype, backend, target.max_model_len, None, tokenizer)
    return ModelDrafter(model, spec.num_speculative_tokens, target.max_model_len, vocab,
                        eos_token_id, kv_caches=[]), draft.hf_config


def self_draft_quantization(spec: SpeculativeConfig, model_path: pathlib.Path,
                            device: str) -> str:
    """The quantization method of a ``self`` draft: ``spec.quantization``, else ``gguf``
    where the registry's default is (a .gguf model, kernels built) and ``int8`` elsewhere,
    on CPU. Raises ``ValueError`` where there is no
    fast inexact path (another device, or a method that is the exact path)."""
    if device != "cpu":
        raise ValueError("speculative_config method 'self' drafts with a fast CPU path (gguf "
                         f"or int8); there is none on {device!r}")
    default = get_quantization_method(None, model_path, device).name  # gguf where it runs
    quant = spec.quantization or ("gguf" if default == "gguf" else "int8")
    if quant not in ("gguf", "int8"):
        raise ValueError("speculative_config.quantization of method 'self' must be gguf or "
                         f"int8 (a fast path; the target verifies exactly); got {quant!r}")
    return quant
