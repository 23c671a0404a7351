"""Shared fixtures: the bundled model, its Hugging Face reference, one float32 engine, and a
tiny random-weight Llama."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

import gguf
import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors under Triton's interpreter
# (tests/test_triton_*.py). The choice is made when triton is first imported, which
# torch._dynamo does as a side effect: so it is made here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.benchmarks.serve import wait_server_started
from pagedserve.distributed import group
from pagedserve.model_loader.files import resolve_model_path

CHAT_QUESTIONS = [
    "hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning' into Spanish and German.",
    ("Give me a short recipe for pancakes, with the ingredients first and then the steps, "
     "and keep it under one hundred words please."),
    ("Summarize the plot of Romeo and Juliet for a ten year old. Mention the two families, "
     "the secret marriage, the misunderstanding at the end, and what the story teaches."),
    "What is 17 times 23?",
]


@pytest.fixture(scope="session")
def model_path():
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama (GQA 4/2 heads, head_dim 16) with random weights, and its HF model."""
    torch.manual_seed(0)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init: clearer argmax margins
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own GGUF loading and dequantization: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm():
    """One exact float32 engine on the bundled model (GGUF weights dequantized, no 8-bit
    activations: token for token as transformers), shared by the end-to-end tests."""
    from pagedserve import LLM

    return LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def chat_prompts(llm):
    """Token ids of the chat questions, built with the model's own chat template."""
    tok = llm.get_tokenizer()
    return [
        list(tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False))
        for q in CHAT_QUESTIONS
    ]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
              cache=None) -> list[int]:
    """Greedy continuation by a plain argmax loop over the reference model's logits
    (with its own KV cache, a fresh ``DynamicCache`` unless given); stops after eos unless
    eos_token_id is None."""
    from transformers import DynamicCache

    out: list[int] = []
    cache = DynamicCache() if cache is None else cache
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == eos_token_id:
                break
            ids = torch.tensor([[token]])
    return out


T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str,
               interval: float = 0.05) -> T:
    """Poll ``predicate()`` until it returns something truthy, and return that.

    For tests that wait on another thread or process (the engine thread, a server): a
    deadline instead of a fixed sleep, so a loaded machine makes the test slower, not red.
    ``timeout`` is in seconds; ``what`` names the condition in the failure message
    (``pytest.fail``), which also shows the predicate's last value.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what} (last value: {got!r})")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test server)."""
    return group.free_port("127.0.0.1")


def wait_server_ready(proc: subprocess.Popen, url: str, log: Callable[[], str],
                      timeout: float) -> None:
    """Poll ``url + "/health"`` until a test server answers 200; fails the test, with the
    server's ``log()``, if its process exits or ``timeout`` seconds pass first."""
    try:
        wait_server_started(proc, url, timeout, log)
    except RuntimeError as e:
        pytest.fail(str(e))


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Terminate ``proc`` if it still runs (killed after ``timeout`` seconds) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gguf_writer(path, arch: str, config) -> gguf.GGUFWriter:
    """A GGUF writer for ``arch`` holding the keys every decoder takes from its Hugging Face
    ``config`` (layers, context, widths, heads, norm epsilon, vocabulary), as llama.cpp's
    converter writes them."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    return w


def llama_cpp_permute(w, n_head: int):
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py: a Q or K weight's HF rows
    (numpy ``[n_head * head_dim, K]``) in GGUF's order."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def finish_gguf(w: gguf.GGUFWriter) -> None:
    """Write the header, key-values and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
