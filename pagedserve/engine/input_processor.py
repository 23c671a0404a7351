"""A new request's prompt and parameters, checked and completed before it is queued (vLLM's
``InputProcessor``): tokenized, truncated, ``max_tokens`` filled in, the model's extra EOS
ids added as stop tokens. Everything wrong with a request is a ``ValueError`` here, before
it reaches the scheduler."""

from __future__ import annotations

import json
from dataclasses import replace

from pagedserve.model_loader.model_config import ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import encode_text

# A prompt: text, token ids, or vLLM's {"prompt_token_ids": [...]} (optionally with its text
# under "prompt") / {"prompt": "..."}.
PromptType = str | list[int] | dict


class InputProcessor:
    """Checks requests against the model (``model_config``), ``max_logprobs`` and
    ``max_num_seqs``; ``tokenizer`` may be None (token-id prompts only)."""

    def __init__(self, tokenizer, model_config: ModelConfig, max_logprobs: int,
                 max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.hf_config.vocab_size
        self.max_logprobs = max_logprobs
        self.max_num_seqs = max_num_seqs
        self.eos_token_id = self._eos_token_id()
        self.extra_eos_token_ids = self._extra_eos_token_ids()

    def process(self, prompt: PromptType, params: SamplingParams
                ) -> tuple[str | None, list[int], SamplingParams]:
        """The prompt's text (None where only ids were given or they were cut), its token
        ids and the completed parameters. Raises ``ValueError`` naming what is wrong."""
        text, token_ids = self._truncate(*self._tokenize(prompt), params.truncate_prompt_tokens)
        params = self._check_params(token_ids, params)
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=[
                *params.stop_token_ids,
                *(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)])
        return text, token_ids, params

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def _extra_eos_token_ids(self) -> list[int]:
        """End-of-sequence ids that ``generation_config.json`` lists besides the main one
        (Llama 3 and Qwen2.5 chat models end turns with them). As vLLM does, requests
        stop on them unless ``ignore_eos``."""
        path = self.model_config.model_path / "generation_config.json"
        if not path.is_file():
            return []
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return [t for t in ids if t != self.eos_token_id]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # with an optional "prompt": its text
                text = prompt.get("prompt")
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True given)")
            return prompt, encode_text(self.tokenizer, prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string, a list of token ids or a dict")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
        return text, prompt

    def _truncate(self, text: str | None, token_ids: list[int], keep: int | None
                  ) -> tuple[str | None, list[int]]:
        """The last ``keep`` prompt tokens (vLLM's ``truncate_prompt_tokens``: -1 means
        ``max_model_len``). The text is dropped when tokens are cut: it would no longer
        match the ids (``echo`` then decodes the ids kept). Raises ``ValueError`` when
        ``keep`` > ``max_model_len``."""
        if keep is None:
            return text, token_ids
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be <= max_model_len "
                             f"({self.max_model_len}) or -1; got {keep}")
        keep = self.max_model_len if keep == -1 else keep
        if len(token_ids) <= keep:
            return text, token_ids
        return None, token_ids[-keep:]

    def _check_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "so no token can be generated")
        if params.max_tokens is None:
            params = replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}), got {value}")
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"n must be <= max_num_seqs ({self.max_num_seqs}), got {params.n}")
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
        return params
