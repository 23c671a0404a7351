"""Multi-LoRA serving end to end (issue 30), with PEFT as the independent reference.

Adapters are made by ``peft.get_peft_model(..., LoraConfig(init_lora_weights=False))`` and
``save_pretrained`` (B is random, so every adapter changes the output; checked). The
reference is ``PeftModel.from_pretrained`` on the same base weights in float32, greedy by
an argmax loop (``conftest.hf_greedy``).

- Tiny random-weight Llama (the fused C++ decode step), Qwen2 (q/k/v biases under the
  LoRA term, a sliding window) and Gemma 3 (local/global layers, soft-capping): four
  adapters (all seven projections; q and v only; ``rank_pattern`` / ``alpha_pattern``;
  ``use_rslora``) and the base, in one mixed batch with more adapters than ``max_loras``
  (admission queues) and than ``max_cpu_loras`` (eviction and reload): token for token
  PEFT's greedy, logprobs within 1e-4; each request alone gives the same bits.
- The bundled SmolLM2 (GGUF, dequantized by transformers for the reference): exact float32
  path == PEFT; the default GGUF path (8-bit activations) changes with the adapter and is
  batch invariant; a JSON schema under an adapter == PEFT masked by xgrammar.
- Prefix caching per adapter load, preemption, chunked prefill, n > 1, the fused decode
  step with LoRA == the Python layers, bad adapters refused by name, removal of an adapter
  in use.

Kernel and scheduler units are in test_lora_kernel.py.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import peft
import pytest
import torch
import transformers
from conftest import hf_greedy

from pagedserve import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from pagedserve.lora.registry import LoRAInUseError
from pagedserve.worker.cpu_decode import CpuDecodeLayers

VOCAB = 96
MAX_TOKENS = 8
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (lora_int_id, LoraConfig arguments)
ADAPTERS = {
    "all7": (1, {"r": 8, "lora_alpha": 16, "target_modules": ALL7}),
    "qv": (2, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    "pattern": (3, {"r": 4, "lora_alpha": 8,
                    "target_modules": ["k_proj", "o_proj", "up_proj", "down_proj"],
                    "rank_pattern": {"down_proj": 8, "layers.0.self_attn.o_proj": 2},
                    "alpha_pattern": {"k_proj": 24, "layers.1.mlp.up_proj": 1}}),
    "rslora": (4, {"r": 8, "lora_alpha": 6, "use_rslora": True,
                   "target_modules": ["q_proj", "k_proj", "gate_proj", "down_proj"]}),
}
SLIDING, FULL = "sliding_attention", "full_attention"
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}
# as tests/test_models.py builds them: qwen2 has q/k/v biases, tied embeddings and a window
# on layers >= 1; gemma3 local/global layers with their own rope, soft-capping
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
                "final_logit_softcapping": 5.0, "layer_types": [SLIDING, FULL, SLIDING],
                "rope_parameters": {
                    SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
                    FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run fastest on one thread (two spin for ~10 ms per op on busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- adapters and references --------------------------------------------------------------


def make_adapter(base_path, model_cls, out: Path, seed: int, save: dict | None = None,
                 **config) -> Path:
    """A PEFT LoRA of the model at ``base_path`` with random A and B, saved to ``out``
    (``save``: ``save_pretrained``'s options)."""
    base = model_cls.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out, **(save or {}))
    return out


def peft_model(base_path, model_cls, adapter: Path | None):
    """The reference: a fresh float32 base, wrapped by ``PeftModel`` when ``adapter``."""
    base = model_cls.from_pretrained(base_path, dtype=torch.float32).eval()
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter).eval()


def token_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """Each generated token's logprob from one uncached forward of the reference."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].double()
    n = len(prompt)
    lp = torch.log_softmax(logits[n - 1 : n - 1 + len(generated)], dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(generated)]


@dataclass
class Family:
    """A tiny model, its adapters, PEFT's greedy answers, and one engine serving them."""

    name: str
    path: Path
    model_cls: type
    adapters: dict[str, Path]
    prompts: list[list[int]]
    refs: dict[tuple[str | None, int], list[int]]  # (adapter, prompt index) -> ids
    ref_logprobs: dict[tuple[str | None, int], list[float]]
    llm: LLM

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else LoRARequest(name, ADAPTERS[name][0],
                                                     str(self.adapters[name]))

    def reference(self, adapter: Path | None, prompt: list[int]) -> list[int]:
        return hf_greedy(peft_model(self.path, self.model_cls, adapter), prompt, MAX_TOKENS,
                         None)


def _prompts(seed: int) -> list[list[int]]:
    """Three prompts of 5, 11 and 19 tokens (partial and full 4-token blocks; longer than
    the sliding window)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 19)]


def _engine(path, **kwargs) -> LLM:
    kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2,
              "block_size": 4, "enable_prefix_caching": True, "max_model_len": 64,
              "kv_cache_memory_bytes": 4 << 20, **kwargs}
    return LLM(str(path), skip_tokenizer_init=True, dtype=kwargs.pop("dtype", "float32"),
               **kwargs)


@pytest.fixture(scope="module")
def families(tiny_llama, tmp_path_factory):
    """Builds each family once, on first use (``get(name)``)."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name in built:
            return built[name]
        root = tmp_path_factory.mktemp(f"lora_{name}")
        if name == "llama":
            path, model_cls = tiny_llama[0], transformers.LlamaForCausalLM
        else:
            config_cls, model_cls, extra = FAMILIES[name]
            torch.manual_seed(0)
            model = model_cls(config_cls(**{**COMMON, **extra})).eval()
            with torch.no_grad():  # weights spread as in test_models.py: clear argmax margins
                for pname, param in model.named_parameters():
                    noise = torch.randn_like(param) * 0.15
                    param.copy_(noise if name == "gemma3" or "norm" not in pname else 1 + noise)
            path = root / "base"
            model.save_pretrained(path)
        adapters = {a: make_adapter(path, model_cls, root / a, seed=10 + i, **cfg)
                    for i, (a, (_, cfg)) in enumerate(ADAPTERS.items())}
        prompts = _prompts(1)
        refs, ref_lps = {}, {}
        for a in [None, *ADAPTERS]:
            model = peft_model(path, model_cls, a and adapters[a])
            for i, p in enumerate(prompts):
                refs[a, i] = hf_greedy(model, p, MAX_TOKENS, None)
                ref_lps[a, i] = token_logprobs(model, p, refs[a, i])
        built[name] = Family(name, path, model_cls, adapters, prompts, refs, ref_lps,
                             _engine(path))
        return built[name]

    return get


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def family(request, families) -> Family:
    return families(request.param)


@pytest.fixture(scope="module")
def llama(families) -> Family:
    return families("llama")


def _mixed(fam: Family):
    """Every (adapter or base, prompt) pair, prompts interleaved so that consecutive
    requests use different adapters."""
    return [(a, i) for i in range(len(fam.prompts)) for a in [None, *ADAPTERS]]


def _generate(llm: LLM, prompts: list[list[int]], loras, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=loras, use_tqdm=False)


# -- 1. each adapter and the base == PEFT -------------------------------------------------


def test_adapters_change_the_reference(family):
    """The test below can fail: every adapter changes PEFT's greedy answer to some prompt,
    and undoing ``use_rslora`` or ``alpha_pattern`` in an adapter's config changes it
    too (so a loader that ignored them would be caught)."""
    for a in ADAPTERS:
        assert any(family.refs[a, i] != family.refs[None, i]
                   for i in range(len(family.prompts))), a
    for a, undo in (("rslora", {"use_rslora": False}), ("pattern", {"alpha_pattern": {}})):
        changed = family.adapters[a].parent / f"{a}-undone"
        shutil.copytree(family.adapters[a], changed, dirs_exist_ok=True)
        config = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**config, **undo}))
        assert any(family.reference(changed, p) != family.refs[a, i]
                   for i, p in enumerate(family.prompts)), a


def test_mixed_batch_matches_peft(family, monkeypatch):
    """All adapters and the base in one batch: 4 adapters through max_loras=2 slots (later
    requests queue) and max_cpu_loras=2 (adapters are evicted and read again): PEFT's
    greedy tokens, logprobs within 1e-4."""
    engine = family.llm.engine
    manager = engine.executor.driver_worker.lora
    reloads, per_step = [], []
    load, prepare = manager.load, manager.prepare_step

    def spy_load(name, path):
        if any(r.lora_name == name for r in engine.loras.requests()):
            reloads.append(name)  # registered already: evicted, read again
        return load(name, path)

    monkeypatch.setattr(manager, "load", spy_load)
    monkeypatch.setattr(manager, "prepare_step", lambda ids, lens: per_step.append(
        {i for i in ids if i}) or prepare(ids, lens))
    pairs = _mixed(family)
    outs = _generate(family.llm, [family.prompts[i] for _, i in pairs],
                     [family.lora(a) for a, _ in pairs])
    for (a, i), out in zip(pairs, outs):
        got = out.outputs[0]
        assert got.token_ids == family.refs[a, i], (family.name, a, i)
        ours = [got.logprobs[k][t].logprob for k, t in enumerate(got.token_ids)]
        assert ours == pytest.approx(family.ref_logprobs[a, i], abs=1e-4), (family.name, a, i)
    assert max(len(s) for s in per_step) == 2  # both slots used, never more
    assert len(set().union(*per_step)) == len(ADAPTERS)
    assert reloads, "no adapter was evicted and read again"


def test_bfloat16_adapter_weights(llama):
    """``lora_dtype="bfloat16"`` holds the adapters rounded to bfloat16 (on a float32
    model): PEFT with its lora_A / lora_B rounded the same way is the reference (these
    adapters' scale is 2, so rounding B * scale equals scaling rounded B), and the
    logprobs moved off the float32 adapter's (the rounding really happened)."""
    llm = _engine(llama.path, lora_dtype="bfloat16")
    names = ["all7", "qv"]
    pairs = [(a, i) for i in range(len(llama.prompts)) for a in names]
    outs = _generate(llm, [llama.prompts[i] for _, i in pairs], [llama.lora(a) for a, _ in pairs])
    moved = False
    for a in names:
        model = peft_model(llama.path, llama.model_cls, llama.adapters[a])
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_" in pname:
                    param.copy_(param.bfloat16().float())
        for (name, i), out in zip(pairs, outs):
            if name != a:
                continue
            got = out.outputs[0]
            assert got.token_ids == hf_greedy(model, llama.prompts[i], MAX_TOKENS, None), (a, i)
            ours = [got.logprobs[k][t].logprob for k, t in enumerate(got.token_ids)]
            want = token_logprobs(model, llama.prompts[i], list(got.token_ids))
            assert ours == pytest.approx(want, abs=1e-4), (a, i)
            if got.token_ids == llama.refs[a, i]:
                moved |= ours != pytest.approx(llama.ref_logprobs[a, i], abs=1e-6)
    assert moved


# -- 3. a request alone == in a mixed batch, bit for bit -----------------------------------


def test_mixed_batch_equals_each_request_alone(family):
    pairs = _mixed(family)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    together = _generate(family.llm, [family.prompts[i] for _, i in pairs],
                         [family.lora(a) for a, _ in pairs], params)
    for (a, i), out in zip(pairs, together):
        alone = _generate(family.llm, [family.prompts[i]], family.lora(a), params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, (a, i)
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs, (a, i)


# -- 4. prefix caching per adapter load ----------------------------------------------------


def _run_engine(engine, requests) -> dict[str, object]:
    """Add ``requests`` ({id: (prompt, lora)}), step once, return the block tables after
    that step and the finished outputs by id."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
    done = {}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if first:
            tables = engine.kv_cache_manager.block_tables()
            first = False
    return {"tables": tables, "outputs": done}


def test_prefix_cache_is_per_adapter(llama):
    """One 13-token prompt (3 full blocks) under adapter all7, adapter qv, the base and
    all7 again, in one step: only the two all7 requests share blocks, and each answer is
    its own PEFT answer. Later, the prompt under all7 hits the cache."""
    engine = llama.llm.engine
    prompt = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = llama.lora("all7"), llama.lora("qv")
    hits = engine.kv_cache_manager.prefix_cache_hits
    run = _run_engine(engine, {"pc-a": (prompt, a), "pc-b": (prompt, b), "pc-base": (prompt, None),
                               "pc-a2": (prompt, a)})
    tables, outs = run["tables"], run["outputs"]
    blocks = {rid: set(t) for rid, t in tables.items() if rid.startswith("pc-")}
    assert len(blocks) == 4
    assert not blocks["pc-a"] & blocks["pc-b"]
    assert not blocks["pc-a"] & blocks["pc-base"] and not blocks["pc-b"] & blocks["pc-base"]
    assert tables["pc-a2"][:3] == tables["pc-a"][:3]  # the same adapter shares its 3 blocks
    assert [o.num_cached_tokens for o in (outs["pc-a"], outs["pc-b"], outs["pc-base"],
                                          outs["pc-a2"])] == [0, 0, 0, 12]
    assert engine.kv_cache_manager.prefix_cache_hits - hits == 12
    want = {name: llama.reference(llama.adapters[name] if name else None, prompt)
            for name in ("all7", "qv", None)}
    assert len({tuple(v) for v in want.values()}) == 3  # three different answers
    assert outs["pc-a"].outputs[0].token_ids == want["all7"]
    assert outs["pc-a2"].outputs[0].token_ids == want["all7"]
    assert outs["pc-b"].outputs[0].token_ids == want["qv"]
    assert outs["pc-base"].outputs[0].token_ids == want[None]
    again = _generate(llama.llm, [prompt], a)[0]
    assert again.num_cached_tokens == 12
    assert again.outputs[0].token_ids == want["all7"]
    stats = llama.llm.kv_cache_stats()
    assert stats.prefix_cache_hits - hits == 24


def test_readded_adapter_does_not_reuse_old_blocks(llama, tmp_path):
    """An adapter removed and added again under the same name, id and path, whose files
    changed in between, computes its prompt afresh and answers as PEFT on the new files
    (the K/V of the old load is still in the cache, and would be hit otherwise)."""
    engine = llama.llm.engine
    folder = tmp_path / "swap"
    shutil.copytree(llama.adapters["qv"], folder)
    lora = LoRARequest("swap", 77, str(folder))
    prompt = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    old = llama.reference(llama.adapters["qv"], prompt)
    new = llama.reference(llama.adapters["rslora"], prompt)
    assert old != new
    first = _generate(llama.llm, [prompt], lora)[0]
    assert first.outputs[0].token_ids == old and first.num_cached_tokens == 0
    second = _generate(llama.llm, [prompt], lora)[0]
    assert second.outputs[0].token_ids == old and second.num_cached_tokens == 12  # it would hit
    assert engine.remove_lora(77)
    assert 77 not in engine.list_loras()
    shutil.copytree(llama.adapters["rslora"], folder, dirs_exist_ok=True)
    third = _generate(llama.llm, [prompt], lora)[0]
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == new
    engine.remove_lora(77)


# -- 5. preemption, chunked prefill, n > 1, structured outputs -----------------------------


def test_preemption_and_chunked_prefill(llama, monkeypatch):
    """A pool of 10 blocks (one sequence needs up to 7) and an 8-token step budget: the
    mixed batch is preempted and its prompts chunked, and still answers as PEFT."""
    llm = _engine(llama.path, num_gpu_blocks_override=10, max_num_batched_tokens=8,
                  max_model_len=32, max_cpu_loras=4)
    sched = llm.engine.scheduler
    preempted, partial = [], []
    schedule, preempt = sched.schedule, sched._preempt

    def spy_schedule():
        out = schedule()
        partial.extend(r.request_id for r, n in zip(out.requests, out.num_scheduled_tokens)
                       if r.num_computed_tokens + n < r.num_tokens)
        return out

    monkeypatch.setattr(sched, "schedule", spy_schedule)
    monkeypatch.setattr(sched, "_preempt", lambda r: preempted.append(r.request_id) or preempt(r))
    pairs = _mixed(llama)
    outs = _generate(llm, [llama.prompts[i] for _, i in pairs], [llama.lora(a) for a, _ in pairs],
                     SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert preempted and partial
    for (a, i), out in zip(pairs, outs):
        assert out.outputs[0].token_ids == llama.refs[a, i], (a, i)


def test_n_samples_with_an_adapter(llama):
    """n=2 greedy: both samples are PEFT's answer; n=2 seeded sampling: sample i is the
    request alone with seed + i (the engine's rule), under the same adapter."""
    lora = llama.lora("pattern")
    p = llama.prompts[1]
    greedy = _generate(llama.llm, [p], lora, SamplingParams(n=2, temperature=0,
                                                            max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in greedy[0].outputs] == [llama.refs["pattern", 1]] * 2
    sample = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    both = _generate(llama.llm, [p], lora, sample)[0].outputs
    for i, c in enumerate(both):
        one = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert c.token_ids == _generate(llama.llm, [p], lora, one)[0].outputs[0].token_ids
    base = _generate(llama.llm, [p], None, SamplingParams(temperature=1.0, seed=11,
                                                          max_tokens=MAX_TOKENS, ignore_eos=True))
    assert base[0].outputs[0].token_ids != both[0].token_ids  # the adapter was applied


def test_ngram_speculation_with_adapters(llama):
    """n-gram speculative decoding (allowed with LoRA: it drafts from the prompt, no model):
    the verified drafts go through the adapter's rows, and the answers stay PEFT's."""
    llm = _engine(llama.path, max_cpu_loras=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    # q + (the adapter's answer to q) + q: the answer to that tends to repeat the first
    # answer, which the n-gram proposer drafts from the prompt
    names = ["all7", "qv", "pattern"]
    q = llama.prompts[1]
    prompts = [q + llama.refs[a, 1] + q for a in names]
    outs = _generate(llm, prompts, [llama.lora(a) for a in names],
                     SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stats = llm.engine.spec_decoding_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    for a, p, out in zip(names, prompts, outs):
        assert out.outputs[0].token_ids == llama.reference(llama.adapters[a], p), a


# -- 7. the fused decode step with LoRA == the Python layers -------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_step_equals_python_layers(llama, dtype, monkeypatch):
    """Six requests (three adapters and the base, steps of 6 rows down to 1) decode through
    the C++ step (``CpuDecodeLayers`` adding the LoRA terms) and through the Python layers:
    the same tokens and logprobs, bit for bit."""
    llm = _engine(llama.path, dtype=dtype, max_loras=3, max_cpu_loras=3,
                  enable_prefix_caching=False)  # the second run prefills as the first
    model = llm.engine.executor.driver_worker.model
    assert model.cpu_decode is not None and model.cpu_decode.lora
    calls = []
    run = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__", lambda self, *args: calls.append(
        (args[1].shape[0], self.lora_batch.slots is not None)) or run(self, *args))
    names = ["all7", "qv", None, "pattern", "all7", None]
    prompts = [llama.prompts[i % 3] for i in range(len(names))]
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True, logprobs=3)
              for i in range(len(names))]
    loras = [llama.lora(a) for a in names]
    fast = _generate(llm, prompts, loras, params)
    # every step after the prefill, with LoRA rows until only the base request is left
    assert set(calls) == {(rows, rows > 1) for rows in range(1, len(names) + 1)}
    monkeypatch.setattr(model, "cpu_decode", None)
    slow = _generate(llm, prompts, loras, params)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    if dtype == "float32":
        for i, a in enumerate(names):
            assert fast[i].outputs[0].token_ids == llama.refs[a, i % 3][: 3 + i]


# -- 6. bad input --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_adapters(llama, tmp_path_factory):
    """name -> (folder, what the error must say)."""
    root = tmp_path_factory.mktemp("bad_loras")
    path, cls = llama.path, transformers.LlamaForCausalLM

    def make(name, **config):
        config.setdefault("r", 4)
        config.setdefault("lora_alpha", 8)
        config.setdefault("target_modules", ["q_proj", "v_proj"])
        return make_adapter(path, cls, root / name, seed=5, **config)

    no_config = root / "no_config"
    shutil.copytree(llama.adapters["qv"], no_config)
    (no_config / "adapter_config.json").unlink()
    other = root / "other_base"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    return {
        "missing": (root / "nowhere", "no such directory"),
        "no_config": (no_config, "no adapter_config.json"),
        "bin_only": (make("bin_only", save={"safe_serialization": False}), r"adapter_model\.bin"),
        "dora": (make("dora", use_dora=True), "use_dora"),
        "modules_to_save": (make("mts", modules_to_save=["lm_head"]), "modules_to_save"),
        "bias": (make("bias", bias="all"), "bias 'all'"),
        # PEFT saves the targeted lm_head's own weight beside its lora_A / lora_B ...
        "lm_head": (make("lm_head", target_modules=["q_proj", "lm_head"]), "lm_head"),
        # ... unless told not to: then only the LoRA pair names the module
        "lm_head_lora_only": (make("lm_head_only", target_modules=["q_proj", "lm_head"],
                                   save={"save_embedding_layers": False}),
                              "target module 'lm_head' is not a projection"),
        "embed_tokens": (make("embed", target_modules=["embed_tokens"]), "embed_tokens"),
        "rank": (make("rank", r=16, lora_alpha=16), "rank 16, above max_lora_rank 8"),
        "other_base": (make_adapter(other, cls, root / "other_lora", seed=5, r=4,
                                    lora_alpha=8, target_modules=["q_proj"]),
                       "another base model"),
    }


BAD = ["missing", "no_config", "bin_only", "dora", "modules_to_save", "bias", "lm_head",
       "lm_head_lora_only", "embed_tokens", "rank", "other_base"]


@pytest.mark.parametrize("bad", BAD)
def test_bad_adapter_is_refused_by_name(llama, bad_adapters, bad):
    """The batch is refused with a ValueError naming the problem, the bad adapter is not
    registered, nothing is left queued, and the engine serves the next batch (with a good
    adapter) as before."""
    folder, message = bad_adapters[bad]
    engine = llama.llm.engine
    lora = LoRARequest(f"bad-{bad}", 500, str(folder))
    p = llama.prompts[0]
    with pytest.raises(ValueError, match=message) as err:
        _generate(llama.llm, [p, p], [llama.lora("qv"), lora])
    assert "bad-" + bad in str(err.value)
    assert 500 not in engine.list_loras()
    assert all(r.lora_name != lora.lora_name for r in engine.loras.requests())
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=message):
        engine.add_lora(lora)
    assert 500 not in engine.list_loras()
    outs = _generate(llama.llm, [p, p], [llama.lora("qv"), None])
    assert [o.outputs[0].token_ids for o in outs] == [llama.refs["qv", 0], llama.refs[None, 0]]


def test_conflicting_registrations_are_refused(llama):
    """An id taken by another path, or a name taken by another id: ValueError, and the
    loaded adapter keeps serving."""
    engine = llama.llm.engine
    p = llama.prompts[0]
    _generate(llama.llm, [p], llama.lora("all7"))
    before = engine.list_loras()
    other_path = LoRARequest("all7", ADAPTERS["all7"][0], str(llama.adapters["qv"]))
    other_id = LoRARequest("all7", 600, str(llama.adapters["all7"]))
    other_name = LoRARequest("renamed", ADAPTERS["all7"][0], str(llama.adapters["all7"]))
    for lora in (other_path, other_id, other_name):
        with pytest.raises(ValueError, match="conflicts"):
            _generate(llama.llm, [p], lora)
        assert engine.list_loras() == before and not engine.has_unfinished_requests()
    assert _generate(llama.llm, [p], llama.lora("all7"))[0].outputs[0].token_ids == \
        llama.refs["all7", 0]


def test_lora_needs_enable_lora_and_one_rank(llama):
    plain = LLM(str(llama.path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        _generate(plain, [llama.prompts[0]], llama.lora("qv"))
    assert not plain.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="enable_lora"):
        plain.engine.add_lora(llama.lora("qv"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(llama.path), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
            tensor_parallel_size=2)


# -- 9. removing an adapter in use ---------------------------------------------------------


def test_remove_lora_in_use_is_refused(llama):
    engine = llama.llm.engine
    lora = LoRARequest("inuse", 90, str(llama.adapters["qv"]))
    p = llama.prompts[2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("inuse-0", {"prompt_token_ids": p}, params, lora_request=lora)
    assert 90 in engine.list_loras()
    with pytest.raises(LoRAInUseError, match="inuse"):  # waiting
        engine.remove_lora(90)
    outs = engine.step()
    assert outs and not outs[0].finished
    with pytest.raises(LoRAInUseError, match="inuse"):  # running
        engine.remove_lora(90)
    assert 90 in engine.list_loras()
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done = out
    assert done.outputs[0].token_ids == llama.refs["qv", 2]  # nothing changed under it
    assert engine.remove_lora(90) is True
    assert 90 not in engine.list_loras()
    assert engine.remove_lora(90) is False


# -- 2. the bundled SmolLM2 ---------------------------------------------------------------

SMOL_TOKENS = 10


@pytest.fixture(scope="module")
def smol_adapter(hf_model, tmp_path_factory):
    """A rank-8 adapter on all seven projections of the dequantized SmolLM2 (a copy: the
    session's ``hf_model`` stays unwrapped), and its PeftModel."""
    folder = tmp_path_factory.mktemp("smol_lora")
    torch.manual_seed(20)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=ALL7, init_lora_weights=False)).eval()
    model.save_pretrained(folder)
    return LoRARequest("smol", 1, str(folder)), model


def _smol(**kwargs) -> LLM:
    return LLM(dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
               max_model_len=512, kv_cache_memory_bytes=64 << 20, **kwargs)


@pytest.fixture(scope="module")
def smol_exact():
    return _smol(quantization="none")


def test_smollm2_matches_peft(smol_exact, smol_adapter, hf_model, chat_prompts):
    """Exact float32 path: two chats under the adapter and one without, in one batch:
    PEFT's greedy (on transformers' dequantized weights) and the base model's."""
    lora, ref_model = smol_adapter
    eos = smol_exact.get_tokenizer().eos_token_id
    prompts = [chat_prompts[1], chat_prompts[2], chat_prompts[1]]
    outs = _generate(smol_exact, prompts, [lora, lora, None],
                     SamplingParams(temperature=0, max_tokens=SMOL_TOKENS))
    want = [hf_greedy(ref_model, p, SMOL_TOKENS, eos) for p in prompts[:2]]
    want.append(hf_greedy(hf_model, prompts[2], SMOL_TOKENS, eos))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0] != want[2]  # the adapter changes the answer


def test_smollm2_json_schema_under_adapter(smol_exact, smol_adapter):
    """A JSON schema under the adapter: valid JSON, and PEFT's greedy masked by xgrammar's
    own Hugging Face logits processor, token for token."""
    import xgrammar as xgr

    lora, ref_model = smol_adapter
    tok = smol_exact.get_tokenizer()
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}}, "required": ["age"]}
    prompt = list(tok.apply_chat_template(
        [{"role": "user", "content": "How old is your grandmother? Answer in JSON."}],
        add_generation_prompt=True, tokenize=True, return_dict=False))
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    got = _generate(smol_exact, [prompt], lora, params)[0].outputs[0]
    jsonschema.validate(json.loads(got.text), schema)
    base = _generate(smol_exact, [prompt], None, params)[0].outputs[0]
    assert base.token_ids != got.token_ids  # the grammar does not hide the adapter
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=ref_model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    ref = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
        logits_processor=transformers.LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)]),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    assert got.token_ids == ref[0, len(prompt):].tolist()


def test_smollm2_gguf_path_is_batch_invariant(smol_adapter, chat_prompts):
    """The default GGUF path (8-bit activations; no exact reference): the adapter changes
    the answer, and each request alone equals itself in the mixed batch, bit for bit."""
    lora, _ = smol_adapter
    llm = _smol()
    prompts = [chat_prompts[1], chat_prompts[2], chat_prompts[1], chat_prompts[2]]
    loras = [lora, lora, None, None]
    params = SamplingParams(temperature=0, max_tokens=SMOL_TOKENS, logprobs=1)
    together = _generate(llm, prompts, loras, params)
    assert together[0].outputs[0].token_ids != together[2].outputs[0].token_ids
    for p, lo, out in zip(prompts, loras, together):
        assert out.outputs[0].finish_reason in ("stop", "length")
        alone = _generate(llm, [p], lo, params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs
