"""Extra end-of-sequence ids from a Hugging Face ``generation_config.json`` stop requests."""

from __future__ import annotations

import json

import torch
import transformers

from pagedserve import LLM, SamplingParams


def test_generation_config_eos_list_stops(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=0, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    prompt = {"prompt_token_ids": [5, 9, 17, 33, 2, 71]}
    free_run = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                   kv_cache_memory_bytes=8 << 20).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free_run[0].outputs[0].token_ids
    # The first position whose token did not occur before: make it an extra eos.
    cut = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] != 0)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [0, tokens[cut]]}))

    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32",
              kv_cache_memory_bytes=8 << 20)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens[: cut + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == tokens
