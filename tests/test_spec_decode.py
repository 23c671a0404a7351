"""Speculative decoding end to end (issue 29): ``ngram``, ``self`` and ``draft_model``.

Every check compares an engine with ``speculative_config`` against an engine of the SAME
settings without it (float32, block size 16, a 16-block pool, prefix caching on): greedy
ids, text, finish reasons, logprobs (bit-equal floats), stop rules and seeded samples must
be those of plain one-token-at-a-time decoding. That reference is the exact float32 path,
which ``test_engine_e2e.py`` checks token for token against transformers (and
``test_batch_invariance.py`` checks invariant to batching, chunking and preemption), so
equality here means the speculative engine decodes exactly as transformers does.

After every ``generate`` the KV pool must be whole (every block free, ``check_integrity``)
and every hash in the prefix-cache table must be the chained hash of a full block of some
(prompt + final output) a request produced: a block holding a rejected draft token would
hash differently and fail the check. The ``draft_model`` draft is a random-weight 2-layer
Llama with SmolLM2's vocabulary: it proposes badly (acceptance near 0), which exercises
rejection on every step; correctness, not speed, is what it is here for.

Engines are module-scoped and run each scenario once (``once`` memoizes the runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

import pytest
import torch
from conftest import CHAT_QUESTIONS
from prometheus_client.parser import text_string_to_metric_families

from pagedserve import LLM, SamplingParams
from pagedserve.args import EngineArgs
from pagedserve.config import SpeculativeConfig
from pagedserve.core.block_pool import hash_block_tokens
from pagedserve.metrics import PrometheusStatLogger, SchedulerStats, SpecDecodingStats

BLOCK = 16
NUM_BLOCKS = 16  # 256 tokens = max_model_len: the smallest pool the engine accepts
COMMON = {"dtype": "float32", "max_model_len": 256, "block_size": BLOCK,
          "num_gpu_blocks_override": NUM_BLOCKS}
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
SELF = {"method": "self", "num_speculative_tokens": K}
DRAFT_K = 2

COPY_QUESTION = ("Repeat exactly: apple, banana, cherry, date, elderberry, fig, grape, "
                 "honeydew, kiwi, lemon.")
CODE_QUESTION = """Rename the variable `total` to `running_sum` in this Python function and \
return the whole function.

```python
def mean_of_positive(values):
    total = 0
    count = 0
    for value in values:
        if value > 0:
            total += value
            count += 1
    if count == 0:
        return 0.0
    return total / count
```"""

# -- helpers ------------------------------------------------------------------------------

# engine -> every (prompt + output, prompt length) it produced
_produced: dict[LLM, list[tuple[list[int], int]]] = {}


def produced_block_hashes(sequences: list[tuple[list[int], int]]) -> set[bytes]:
    """Chained hash of every full block of every sequence, chained as
    ``KVCacheManager._block_hashes`` chains them."""
    hashes = set()
    for seq, _ in sequences:
        parent = None
        for i in range(len(seq) // BLOCK):
            parent = hash_block_tokens(parent, seq[i * BLOCK:(i + 1) * BLOCK])
            hashes.add(parent)
    return hashes


def check_pool(llm: LLM) -> None:
    """No leaked block, pool invariants hold, every cached hash is a produced block."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    assert kv.pool.num_free_blocks == engine.num_blocks == NUM_BLOCKS
    kv.check_integrity()
    allowed = produced_block_hashes(_produced.get(llm, []))
    stray = [kv.pool.cached[h].block_id for h in kv.pool.cached if h not in allowed]
    assert not stray, f"cached blocks {stray} hold tokens no request produced"


def run(llm: LLM, prompts: list[list[int]], params) -> list:
    """``generate`` on token prompts, recording what was produced, then ``check_pool``."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seqs = _produced.setdefault(llm, [])
    for o in outs:
        seqs.extend((list(o.prompt_token_ids) + list(c.token_ids), len(o.prompt_token_ids))
                    for c in o.outputs)
    check_pool(llm)
    return outs


def completions(outs) -> list[list[tuple]]:
    """Per request, per sample: (token ids, text, finish_reason, stop_reason)."""
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def logprob_table(outs) -> list[list]:
    """Per request and sample: each position's sorted (token, logprob, rank) entries, and
    the cumulative logprob (floats compared exactly)."""
    return [[([sorted((t, lp.logprob, lp.rank) for t, lp in pos.items()) for pos in c.logprobs],
              c.cumulative_logprob) for c in o.outputs] for o in outs]


def check_counters(stats: SpecDecodingStats, k: int) -> None:
    """Acceptance counters consistent: accepted <= verified <= k per draft, per-position
    counts non-increasing and summing to the accepted total."""
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == k
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_drafts
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    assert per_pos[0] <= stats.num_drafts


def delta(before: SpecDecodingStats, after: SpecDecodingStats) -> SpecDecodingStats:
    return SpecDecodingStats(
        after.num_spec_tokens, after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        [a - b for a, b in zip(after.num_accepted_tokens_per_pos,
                               before.num_accepted_tokens_per_pos)])


@dataclass
class Run:
    """One ``generate`` of a scenario on one engine, and what it did."""

    outs: list
    stats: SpecDecodingStats | None  # spec-decode counts it added (None: no speculation)
    num_preemptions: int  # preemptions during it
    num_output_blocks_cached: int  # cached blocks holding output tokens, right after it


_runs: dict[tuple[LLM, str], Run] = {}


def once(llm: LLM, key: str, prompts: list[list[int]], params) -> Run:
    """Scenario ``key`` run on ``llm`` (memoized: each engine runs each scenario once)."""
    if (llm, key) not in _runs:
        engine = llm.engine
        before, preemptions = engine.spec_decoding_stats(), engine.scheduler.num_preemptions
        outs = run(llm, prompts, params)
        stats = None
        if before is not None:
            stats = delta(before, engine.spec_decoding_stats())
            check_counters(stats, stats.num_spec_tokens)
            check_counters(engine.spec_decoding_stats(), stats.num_spec_tokens)
        _runs[llm, key] = Run(outs, stats, engine.scheduler.num_preemptions - preemptions,
                              len(output_block_hashes(_produced[llm])
                                  & set(engine.kv_cache_manager.pool.cached)))
    return _runs[llm, key]


def output_block_hashes(sequences: list[tuple[list[int], int]]) -> set[bytes]:
    """Hashes of the full blocks that hold output tokens (not only prompt tokens)."""
    hashes = set()
    for seq, prompt_len in sequences:
        parent = None
        for i in range(len(seq) // BLOCK):
            parent = hash_block_tokens(parent, seq[i * BLOCK:(i + 1) * BLOCK])
            if (i + 1) * BLOCK > prompt_len:
                hashes.add(parent)
    return hashes


# -- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ref_llm():
    """The same engine settings without speculation: the reference of every check."""
    return LLM(quantization="none", **COMMON)


@pytest.fixture(scope="module")
def prompts(ref_llm):
    tok = ref_llm.get_tokenizer()

    def chat(question: str) -> list[int]:
        return list(tok.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False))

    return {"copy": chat(COPY_QUESTION), "code": chat(CODE_QUESTION),
            "chats": [chat(q) for q in CHAT_QUESTIONS], "eos": tok.eos_token_id}


def ngram_cli_json() -> str:
    """``--speculative-config`` as the CLI hands it to the engine: a JSON string."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", json.dumps(NGRAM)]))
    return args.speculative_config


@pytest.fixture(scope="module")
def ngram_llm():
    # Built from the JSON string (the CLI's form); the dict form is checked equal below.
    return LLM(quantization="none", speculative_config=ngram_cli_json(), **COMMON)


@pytest.fixture(scope="module")
def self_llm():
    return LLM(speculative_config=SELF, **COMMON)  # target quantization: none (exact)


def random_llama(path, vocab_size: int, like) -> None:
    """A 2-layer random-weight Llama of ``vocab_size`` tokens, saved as safetensors."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=like.max_position_embeddings,
        rope_theta=getattr(like, "rope_theta", 10000.0), rms_norm_eps=like.rms_norm_eps,
        bos_token_id=like.bos_token_id, eos_token_id=like.eos_token_id,
        tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, ref_llm):
    path = tmp_path_factory.mktemp("draft_smollm2_vocab")
    random_llama(path, ref_llm.engine.hf_config.vocab_size, ref_llm.engine.hf_config)
    return path


@pytest.fixture(scope="module")
def draft_model_llm(draft_dir):
    return LLM(quantization="none", **COMMON, speculative_config={
        "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": DRAFT_K})


def engine(request, method: str) -> LLM:
    return request.getfixturevalue(f"{method}_llm")


# -- scenarios ----------------------------------------------------------------------------

def alone(prompts) -> tuple[list[list[int]], SamplingParams]:
    """One request whose answer copies a list from its prompt."""
    return [prompts["copy"]], SamplingParams(temperature=0, max_tokens=32)


def mixed_batch(prompts) -> tuple[list[list[int]], list[SamplingParams]]:
    """Five requests of 31-119 prompt tokens, one with n=2, some ignoring eos; all at
    their full length they would hold 29 blocks, more than the pool's 16."""
    chats = prompts["chats"]
    return ([prompts["copy"], chats[0], chats[2], prompts["code"], chats[7]], [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=16, n=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    ])


METHODS = ["ngram", "self", "draft_model"]


def acceptance(stats: SpecDecodingStats) -> str:
    return (f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} accepted, "
            f"per position {stats.num_accepted_tokens_per_pos}")


@pytest.mark.parametrize("method", METHODS)
def test_greedy_alone_matches_no_speculation(request, method, ref_llm, prompts):
    """One request: the same ids, text and finish reason; acceptance as expected."""
    llm = engine(request, method)
    expected = once(ref_llm, "alone", *alone(prompts))
    got = once(llm, "alone", *alone(prompts))
    assert completions(got.outs) == completions(expected.outs)
    assert len(expected.outs[0].outputs[0].token_ids) >= 16
    assert got.stats.num_drafts > 0
    print(f"\n{method} alone: {acceptance(got.stats)}")
    if method == "ngram":  # the answer copies the prompt's list
        assert got.stats.num_accepted_tokens > 0
    if method == "self":  # the fast path agrees with the exact one almost always
        assert got.stats.num_accepted_tokens / got.stats.num_draft_tokens > 0.8


@pytest.mark.parametrize("method", METHODS)
def test_greedy_mixed_batch_with_preemption(request, method, ref_llm, prompts):
    llm = engine(request, method)
    expected = once(ref_llm, "mixed", *mixed_batch(prompts))
    got = once(llm, "mixed", *mixed_batch(prompts))
    assert got.num_preemptions > 0, "the small pool must preempt"
    assert completions(got.outs) == completions(expected.outs)
    assert [len(o.outputs) for o in got.outs] == [1, 1, 2, 1, 1]
    assert got.outs[2].outputs[0].token_ids == got.outs[2].outputs[1].token_ids  # greedy
    assert got.stats.num_drafts > 0
    print(f"\n{method} mixed batch: {acceptance(got.stats)}, "
          f"{got.num_preemptions} preemptions (reference: {expected.num_preemptions})")


# Not ``self``: whether its greedy drafts (the fast path's) ever differ from the exact
# path's tokens in this batch depends on the CPU's kernels (on an AMX Xeon all 77 agreed);
# the caching of rejected positions is the scheduler's, the same for every method.
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rejected_drafts_never_cached(request, method, ref_llm, prompts):
    """The mixed batch rejected drafts; right after it the prefix-cache table held blocks
    of output tokens (positions that were speculated), and every cached hash was a block
    of a produced sequence (``check_pool``, run after every generate and again now)."""
    llm = engine(request, method)
    got = once(llm, "mixed", *mixed_batch(prompts))
    assert got.stats.num_draft_tokens > got.stats.num_accepted_tokens, "no draft rejected"
    assert got.num_output_blocks_cached > 0
    check_pool(llm)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_prefix_cache_hits_keep_output(request, method, ref_llm, prompts):
    """A second identical prompt hits the cache; so does the prompt extended by the first
    answer, whose hit reaches into blocks written while speculating."""
    llm = engine(request, method)
    prompt = prompts["chats"][4]
    first = [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = once(llm, "prefix-1", *first)
    assert completions(got.outs) == completions(once(ref_llm, "prefix-1", *first).outs)
    extended = prompt + list(got.outs[0].outputs[0].token_ids)
    second = [prompt, extended], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = once(llm, "prefix-2", *second)
    assert completions(got.outs) == completions(once(ref_llm, "prefix-2", *second).outs)
    assert got.outs[0].num_cached_tokens > 0
    assert got.outs[1].num_cached_tokens > len(prompt)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_logprobs_bit_equal(request, method, ref_llm, prompts):
    llm = engine(request, method)
    batch = ([prompts["copy"], prompts["chats"][2]],
             SamplingParams(temperature=0, max_tokens=16, logprobs=2))
    expected = once(ref_llm, "logprobs", *batch)
    got = once(llm, "logprobs", *batch)
    assert got.stats.num_accepted_tokens > 0  # logprobs of accepted drafts are compared
    assert completions(got.outs) == completions(expected.outs)
    assert logprob_table(got.outs) == logprob_table(expected.outs)
    for o in got.outs:  # greedy: each token is its position's rank 1, one of the top 2
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 16
        assert all(len(pos) == 2 and pos[t].rank == 1 for pos, t in zip(c.logprobs, c.token_ids))


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_stop_rules_and_max_tokens(request, method, ref_llm, prompts):
    """Stop string and stop token id from the middle of the plain answer, min_tokens over
    an early eos, max_tokens just past a step: as without speculation, and cut where the
    plain answer says they should be."""
    llm = engine(request, method)
    full = once(ref_llm, "alone", *alone(prompts)).outs[0].outputs[0]
    ids, text = list(full.token_ids), full.text
    mid = len(text) // 2
    stop_str = text[mid:mid + 4]
    assert stop_str.strip() and text.find(stop_str) > 0
    j = next(i for i in range(len(ids) // 2, len(ids)) if ids[i] not in ids[:i])
    hi = prompts["chats"][0]
    hi_plain = once(ref_llm, "mixed", *mixed_batch(prompts)).outs[1].outputs[0]
    assert hi_plain.finish_reason == "stop" and len(hi_plain.token_ids) < 12  # eos early
    copy = prompts["copy"]
    batch = ([copy, copy, hi, copy, copy], [
        SamplingParams(temperature=0, max_tokens=32, stop=[stop_str]),
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[ids[j]]),
        SamplingParams(temperature=0, max_tokens=18, min_tokens=14),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=7),
    ])
    expected = once(ref_llm, "stops", *batch)
    got = once(llm, "stops", *batch)
    assert completions(got.outs) == completions(expected.outs)
    assert got.stats.num_accepted_tokens > 0

    by_string, by_token, min_tok, five, seven = (o.outputs[0] for o in got.outs)
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop_str
    assert by_string.text == text[:text.find(stop_str)]
    assert by_string.token_ids == ids[:len(by_string.token_ids)] and by_string.token_ids
    assert by_token.finish_reason == "stop" and by_token.stop_reason == ids[j]
    assert by_token.token_ids == ids[:j + 1]
    assert len(min_tok.token_ids) >= 14 and prompts["eos"] not in min_tok.token_ids[:14]
    assert (five.token_ids, five.finish_reason) == (ids[:5], "length")
    assert (seven.token_ids, seven.finish_reason) == (ids[:7], "length")


def test_seeded_sampling_ngram_same_tokens(ngram_llm, ref_llm, prompts):
    """One-hot verification keeps exactly the tokens the sampler draws one at a time, so
    a seeded request samples what it samples without speculation."""
    batch = ([prompts["copy"], prompts["chats"][2]],
             [SamplingParams(temperature=0.8, seed=1, max_tokens=32),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16)])
    expected = once(ref_llm, "seeded", *batch)
    got = once(ngram_llm, "seeded", *batch)
    assert got.stats.num_draft_tokens > 0 and got.stats.num_accepted_tokens > 0
    assert completions(got.outs) == completions(expected.outs)
    print(f"\nngram seeded: {acceptance(got.stats)}")


def test_seeded_sampling_self_reproducible(self_llm, prompts):
    """``self`` verifies sampled drafts by rejection sampling (not the plain sampler's
    draws), keyed by (seed, position): a seeded request gets the same tokens alone and
    beside another request."""
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    alone_run = once(self_llm, "seeded-alone", [prompts["copy"]], seeded)
    beside = once(self_llm, "seeded-beside", [prompts["chats"][2], prompts["copy"]],
                  [SamplingParams(temperature=0, max_tokens=16), seeded])
    assert alone_run.stats.num_draft_tokens > 0
    assert completions(beside.outs)[1] == completions(alone_run.outs)[0]


def test_chunked_prefill_and_budget_cut_drafts_ngram(prompts):
    """A token budget of 8 per step: prompts are prefilled in chunks and the drafts of
    requests verifying together are cut short by the budget; output as without them."""
    settings = {**COMMON, "quantization": "none", "max_num_batched_tokens": 8}
    plain, spec = LLM(**settings), LLM(**settings, speculative_config=NGRAM)
    batch = ([prompts["copy"], prompts["chats"][2], prompts["chats"][0]],
             SamplingParams(temperature=0, max_tokens=16))
    got = once(spec, "budget-8", *batch)
    assert completions(got.outs) == completions(once(plain, "budget-8", *batch).outs)
    assert got.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_request_growing_to_max_model_len_in_a_pool_of_that_size(request, method, ref_llm):
    """A lone request that grows to ``max_model_len`` (256 tokens) in a pool of exactly 256
    tokens (the smallest pool the engine accepts) finishes as without speculation: near
    the end no draft fits, so none may be asked for (a draft model's lookahead slots
    included). Driven by ``step()`` with a bound, so a stuck engine fails, not hangs."""
    llm, rid = engine(request, method), "to-max-model-len"
    prompt = list(range(1000, 1240))
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = once(ref_llm, "to-max-model-len", [prompt], params)
    eng, outs = llm.engine, []
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    try:
        for _ in range(40):  # 16 tokens take at most 17 steps, with a preemption or two
            outs += eng.step()
            if not eng.has_unfinished_requests():
                break
        stuck = eng.scheduler.get_request(rid)
        assert stuck is None, (
            f"stuck after {stuck.num_output_tokens} tokens ({stuck.num_tokens} of 256), "
            f"status {stuck.status.name}, {eng.scheduler.num_preemptions} preemptions")
    finally:
        stuck = eng.scheduler.get_request(rid)
        if stuck is not None:  # what it computed may be cached: count it as produced
            _produced.setdefault(llm, []).append((list(stuck.all_token_ids), len(prompt)))
            eng.abort_request(rid)
    final = [o for o in outs if o.finished]
    _produced.setdefault(llm, []).append((prompt + list(final[0].outputs[0].token_ids),
                                          len(prompt)))
    check_pool(llm)
    assert completions(final) == completions(expected.outs)
    assert len(final[0].outputs[0].token_ids) == 16


# -- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}}, "method"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
     "num_speculative_tokens"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "k": 3}},
     "unknown keys"),
    ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2'}, "JSON"),
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, "model"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_min": 4, "prompt_lookup_max": 2}},
     "prompt_lookup_min"),
    ({"speculative_config": {"method": "self", "num_speculative_tokens": 2},
      "quantization": "int8"}, "quantization"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_min": 0}}, "prompt_lookup_min"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_min": "2"}}, "prompt_lookup_min"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": True}},
     "num_speculative_tokens"),
    ({"speculative_config": {"method": "self", "num_speculative_tokens": 2,
                             "disable_by_batch_size": "16"}}, "disable_by_batch_size"),
])
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"speculative_config.*{field}|{field}.*speculative"):
        LLM(**{**COMMON, **kwargs})


def test_draft_of_another_vocabulary_rejected(tiny_llama, draft_dir):
    """A draft of SmolLM2's 49152 tokens for the tiny 96-token target (conftest's)."""
    with pytest.raises(ValueError, match=r"speculative_config\.model.* 49152 tokens.* 96"):
        LLM(model=str(tiny_llama[0]), skip_tokenizer_init=True, dtype="float32",
            num_gpu_blocks_override=16, max_model_len=128, speculative_config={
                "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2})


def test_self_without_a_fast_path_rejected(tiny_llama):
    """``self`` drafting through the exact path (quantization none) is no fast path."""
    with pytest.raises(ValueError, match=r"speculative_config\.quantization.*gguf or int8"):
        LLM(model=str(tiny_llama[0]), skip_tokenizer_init=True, dtype="float32",
            num_gpu_blocks_override=16, max_model_len=128, speculative_config={
                "method": "self", "quantization": "none", "num_speculative_tokens": 2})


def test_json_string_config_same_as_dict(ngram_llm):
    """The CLI passes ``--speculative-config`` through as JSON text; the engine built from
    it (``ngram_llm``, whose outputs the tests above compare) parses it as the dict."""
    text = ngram_cli_json()
    assert isinstance(text, str) and json.loads(text) == NGRAM
    parsed = SpeculativeConfig.from_dict(NGRAM)
    assert ngram_llm.engine.spec_config == parsed == SpeculativeConfig.from_dict(text)
    assert (parsed.method, parsed.num_speculative_tokens, parsed.prompt_lookup_min,
            parsed.prompt_lookup_max) == ("ngram", K, 2, 5)


# -- Prometheus ---------------------------------------------------------------------------

def spec_samples(logger: PrometheusStatLogger) -> dict[tuple, float]:
    """(sample name, position label or None) -> value of every spec_decode sample."""
    text = logger.render().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode"):
                assert s.labels["model_name"] == "m" and s.labels["engine"] == "0"
                found[(s.name, s.labels.get("position"))] = s.value
    return found


def test_prometheus_spec_decode_counters():
    logger = PrometheusStatLogger("m", 320)
    first = SpecDecodingStats(3, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                              num_accepted_tokens_per_pos=[2, 1, 1])
    logger.record(SchedulerStats(spec_decoding=first), None)
    second = SpecDecodingStats(3, num_drafts=5, num_draft_tokens=14, num_accepted_tokens=9,
                               num_accepted_tokens_per_pos=[5, 3, 1])
    logger.record(SchedulerStats(num_running_reqs=1, spec_decoding=second), None)
    found = spec_samples(logger)
    name = "vllm:spec_decode_num_"
    assert {k: v for k, v in found.items() if k[0].endswith("_total")} == {
        (name + "drafts_total", None): 5.0,
        (name + "draft_tokens_total", None): 14.0,
        (name + "accepted_tokens_total", None): 9.0,
        (name + "accepted_tokens_per_pos_total", "0"): 5.0,
        (name + "accepted_tokens_per_pos_total", "1"): 3.0,
        (name + "accepted_tokens_per_pos_total", "2"): 1.0,
    }
    text = logger.render().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",' \
           'position="0"} 5.0' in text


def test_prometheus_no_spec_counters_without_speculation():
    logger = PrometheusStatLogger("m", 320)
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_queries=10), None)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_queries=20), None)
    text = logger.render().decode()
    assert "vllm:prefix_cache_queries_total" in text  # the logger did render its series
    assert "spec_decode" not in text and spec_samples(logger) == {}
