"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields

from tqdm import tqdm

from pagedserve.args import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheStats
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

ChatMessages = list[dict]


class LLM:
    """Generate text from a model with the paged KV cache and continuous batching.

    Args:
        model: Hugging Face model directory, ``.gguf`` file, or None for the bundled
            SmolLM2-135M-Instruct.
        **kwargs: any ``EngineArgs`` field (``dtype``, ``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``max_model_len``, ``num_gpu_blocks_override``, ...).

    Raises:
        ValueError: unknown argument, bad value, unsupported model.
        FileNotFoundError: the model path does not exist.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM arguments {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_stats(self) -> KVCacheStats:
        """Blocks in the KV pool right now: total, free, used, cached; tokens stored."""
        return self.engine.kv_cache_stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in input order.

        ``prompts``: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
        ``sampling_params``: one for all prompts or one per prompt (default
        ``SamplingParams()``). ``lora_request``: the LoRA adapter of every prompt, or one
        per prompt (None: the base model); needs ``enable_lora=True``. Raises
        ``ValueError`` for any bad prompt, parameter or adapter before anything runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} lora_request")
        ids = []
        try:
            for prompt, params, lora in zip(prompts, sampling_params, lora_request):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params, lora_request=lora)
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate.

        ``messages``: ``[{"role": ..., "content": ...}, ...]`` or a list of such lists.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True given)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, return_dict=False)
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        with bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]
