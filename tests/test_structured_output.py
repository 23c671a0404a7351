"""Structured outputs (issue 14), offline: token ids against transformers' ``generate`` with
xgrammar's own Hugging Face logits processor, outputs checked by ``jsonschema`` / ``re`` /
xgrammar's matcher, batch invariance, preemption, n > 1, EOS edge cases and bad input.

Grammar mechanics run on two tiny random models (Llama, Qwen2) that use the bundled model's
tokenizer (vocabulary 49152); the real end-to-end checks use the bundled SmolLM2-135M.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.grammar import MAX_WHITESPACE, grammar_from_spec

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["Paris", "London", "Berlin"]


def _tiny(kind: str, tok, path) -> transformers.PreTrainedModel:
    torch.manual_seed(1)
    common = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 256, "eos_token_id": tok.eos_token_id}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # larger weights than the default init: clearer argmax margins
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_models(llm, tmp_path_factory):
    """{"llama": (path, hf model), "qwen2": ...}: random weights, the bundled tokenizer."""
    tok = llm.get_tokenizer()
    out = {}
    for kind in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"tiny_{kind}")
        out[kind] = (path, _tiny(kind, tok, path))
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    return LLM(str(tiny_models["llama"][0]), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=16 << 20)


def _chat(tok, question: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def _hf_constrained(model, tok, prompt: list[int], kind: str, value, max_new: int) -> list[int]:
    """Greedy ids of transformers' generate, masked by xgrammar's own HF logits processor on
    a grammar compiled here (choice: as the regex ``(a|b|c)``)."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    if kind == "json":
        compiled = compiler.compile_json_schema(json.dumps(value), any_whitespace=False,
                                                separators=(",", ":"))
    elif kind == "regex":
        compiled = compiler.compile_regex(value)
    else:
        compiled = compiler.compile_regex("(" + "|".join(map(re.escape, value)) + ")")
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
        logits_processor=transformers.LogitsProcessorList(
            [xgr.contrib.hf.LogitsProcessor(compiled)]),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return out[0, len(prompt):].tolist()


def _spec(kind: str, value) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=value, disable_any_whitespace=True)
    return StructuredOutputsParams(**{kind: value})


CASES = [("json", PERSON), ("regex", DATE), ("choice", CHOICES)]
QUESTIONS = ["Describe a person as JSON.", "When did the war end?", "Capital of France?"]


AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                 "maximum": 120}}, "required": ["age"]}
YEAR = r"(19|20)\d\d"
# Short outputs (5-8 tokens): transformers' generate on the 135M model is the slow part.
BUNDLED_CASES = [("json", AGE), ("regex", YEAR), ("choice", CHOICES)]
BUNDLED_QUESTIONS = ["How old is your grandmother? Answer in JSON.", "When did the war end?",
                     "Capital of France?"]


def test_bundled_model_matches_transformers_with_xgrammar(llm, hf_model):
    tok = llm.get_tokenizer()
    prompts = [_chat(tok, q) for q in BUNDLED_QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=_spec(k, v))
              for k, v in BUNDLED_CASES]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for (kind, value), prompt, out in zip(BUNDLED_CASES, prompts, outs):
        ref = _hf_constrained(hf_model, tok, prompt, kind, value, 16)
        got = out.outputs[0]
        assert got.token_ids == ref, kind
        assert got.finish_reason == "stop" and ref[-1] == tok.eos_token_id
    age, year, city = (o.outputs[0].text for o in outs)
    jsonschema.validate(json.loads(age), AGE)
    assert re.fullmatch(YEAR, year) and city in CHOICES


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_models_match_transformers_with_xgrammar(tiny_models, tiny_llm, llm, kind):
    path, model = tiny_models[kind]
    tok = llm.get_tokenizer()
    runner = tiny_llm if kind == "llama" else LLM(str(path), dtype="float32", max_model_len=256,
                                                  kv_cache_memory_bytes=16 << 20)
    prompts = [_chat(tok, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=_spec(k, v))
              for k, v in CASES]
    outs = runner.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for (k, value), prompt, out in zip(CASES, prompts, outs):
        assert out.outputs[0].token_ids == _hf_constrained(model, tok, prompt, k, value, 24), k



def _bounded(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 8}
# Every string and array is bounded: a 135M model otherwise wanders until max_tokens.
SCHEMAS = [
    PERSON,
    _bounded({"city": SHORT, "country": SHORT}),
    _bounded({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    _bounded({"color": {"enum": ["red", "green", "blue"]}}),
    _bounded({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    _bounded({"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}),
    _bounded({"owner": _bounded({"name": SHORT, "id": {"type": "integer", "minimum": 1,
                                                       "maximum": 99}})}),
    _bounded({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    _bounded({"name": SHORT, "nick": SHORT}, required=["name"]),
    _bounded({"points": {"type": "array", "minItems": 2, "maxItems": 2,
                         "items": {"type": "integer", "minimum": -5, "maximum": 5}}}),
]


def test_schema_suite_validates_greedy_and_sampled(llm):
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": _chat(tok, "Answer with a JSON object.")}
    params = []
    for i, schema in enumerate(SCHEMAS):
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        params.append(SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec))
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=60,
                                     structured_outputs=spec))
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        got = out.outputs[0]
        assert got.finish_reason == "stop", (i, got.text)
        jsonschema.validate(json.loads(got.text), SCHEMAS[i // 2])


def _ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_unconstrained_rows_unchanged_by_constrained_neighbours(tiny_llm, llm):
    tok = llm.get_tokenizer()
    free = [{"prompt_token_ids": _chat(tok, q)} for q in ("hi", "Tell me a joke.")]
    free_params = [SamplingParams(temperature=0, max_tokens=12),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=12)]
    alone = tiny_llm.generate(free, free_params, use_tqdm=False)
    constrained = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=_spec(k, v))
                   for k, v in CASES]
    mixed = tiny_llm.generate(
        [free[0], *[free[1]] * 3, free[1]],
        [free_params[0], *constrained, free_params[1]], use_tqdm=False)
    assert _ids([mixed[0], mixed[-1]]) == _ids(alone)


def test_preemption_and_n3_keep_grammar_state(tiny_models, tiny_llm, llm):
    tok = llm.get_tokenizer()
    questions = [*QUESTIONS, "Write a long sentence.", "Name some animals.", "Count."]
    prompts = [{"prompt_token_ids": _chat(tok, q)} for q in questions]
    long_text = ("regex", "[a-z ]{30,200}")  # cannot end before 30 characters
    greedy = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=_spec(k, v))
              for k, v in [*CASES, long_text, long_text, long_text]]
    expected = _ids(tiny_llm.generate(prompts, greedy, use_tqdm=False))
    # 6 prompts of ~35 tokens growing by up to 24 need ~22 blocks of 16: 10 force preemption.
    # Chunked prefill too: ~35-token prompts, 32 tokens a step.
    small = LLM(str(tiny_models["llama"][0]), dtype="float32", max_model_len=128,
                num_gpu_blocks_override=10, enable_prefix_caching=False,
                max_num_batched_tokens=32)
    assert _ids(small.generate(prompts, greedy, use_tqdm=False)) == expected
    assert small.engine.scheduler.num_preemptions > 0

    small.engine.add_request("aborted", prompts[0], greedy[3])  # abort mid-output
    while not small.engine.output_processor.parents["aborted"].samples[0].request.output_token_ids:
        small.engine.step()
    small.engine.abort_request("aborted")
    assert not small.engine.has_unfinished_requests()

    word = r"[a-z]{1,12}( [a-z]{1,12}){0,3}"
    n3 = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(regex=word))
    (out,) = small.generate(prompts[:1], n3, use_tqdm=False)
    assert len({c.text for c in out.outputs}) > 1  # each sample has its own matcher
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(word, c.text), c.text
    n3_greedy = SamplingParams(n=3, temperature=0, max_tokens=24, structured_outputs=_spec(
        "json", PERSON))
    (out,) = small.generate(prompts[:1], n3_greedy, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
    stats = small.kv_cache_stats()
    assert stats.free_blocks == stats.total_blocks


def test_finished_grammar_keeps_eos_allowed(tiny_llm, llm):
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": _chat(tok, "Say yes.")}
    spec = StructuredOutputsParams(choice=["yes"])
    (yes_ids,) = [tok.encode("yes", add_special_tokens=False)]
    eos = tok.eos_token_id
    min_tok, ignore = tiny_llm.generate([prompt] * 2, [
        SamplingParams(temperature=0, min_tokens=6, max_tokens=10, structured_outputs=spec),
        SamplingParams(temperature=0.7, seed=1, ignore_eos=True, max_tokens=6,
                       structured_outputs=spec)], use_tqdm=False)
    pad = len(yes_ids)
    assert min_tok.outputs[0].token_ids == yes_ids + [eos] * (6 - pad)
    assert (min_tok.outputs[0].text, min_tok.outputs[0].finish_reason) == ("yes", "stop")
    assert ignore.outputs[0].token_ids == yes_ids + [eos] * (6 - pad)
    assert (ignore.outputs[0].text, ignore.outputs[0].finish_reason) == ("yes", "length")


def test_length_cut_and_stop_string(tiny_llm, llm):
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": _chat(tok, "hello")}
    cut, stopped = tiny_llm.generate([prompt] * 2, [
        SamplingParams(temperature=0, max_tokens=3, structured_outputs=_spec("json", PERSON)),
        SamplingParams(temperature=0, max_tokens=20, stop=[" is"],
                       structured_outputs=StructuredOutputsParams(choice=["Paris is big"]))],
        use_tqdm=False)
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3
    assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == ("Paris", "stop")


def _accepts(spec: StructuredOutputsParams, text: str) -> bool:
    """True if ``spec``'s grammar accepts the whole of ``text`` (a matcher over no
    vocabulary, fed characters)."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
        grammar_from_spec(spec))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_json_whitespace_bounded_or_none():
    """Free whitespace between JSON tokens is bounded (a small model otherwise emits it
    until max_tokens); disable_any_whitespace leaves none outside strings (compact JSON)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    free = StructuredOutputsParams(json=schema)
    for ws in (" " * MAX_WHITESPACE, "\n" + " " * (MAX_WHITESPACE - 1)):
        assert _accepts(free, '{' + ws + '"a" : "x y" }')
        assert not _accepts(free, '{' + ws + ' "a": "x y"}')
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert _accepts(compact, '{"a":"x y"}')
    assert not _accepts(compact, '{"a": "x y"}') and not _accepts(compact, '{ "a":"x y"}')
    any_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    assert _accepts(any_object, '{"a":[1,{"b":null}]}')
    assert not _accepts(any_object, '{"a":[1, 2]}')


def test_disable_any_whitespace_gives_compact_json(llm):
    tok = llm.get_tokenizer()
    schema = _bounded({"city": SHORT, "tags": {"type": "array", "items": SHORT,
                                               "minItems": 2, "maxItems": 2}})
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    (out,) = llm.generate({"prompt_token_ids": _chat(tok, "Describe Paris as JSON.")}, params,
                          use_tqdm=False)
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


# Three tools without parameters and a question none of them answers (issue 32): without a
# bound on whitespace the bundled model wrote '[{"name": "list_tables", "parameters": {'
# and then whitespace until max_tokens.
NO_PARAMETER_TOOLS = [{"type": "function", "function": {"name": name, "description": what}}
                      for name, what in [("list_tables", "List the database's tables"),
                                         ("get_time", "The current time"),
                                         ("get_date", "Today's date")]]


def test_required_tool_choice_ends_with_tool_calls(llm):
    """``tool_choice: "required"`` constrained as the server does it, greedy: a complete
    call, not whitespace until ``max_tokens`` (what this request gave before whitespace was
    bounded, here and with --dtype bfloat16)."""
    from pagedserve.entrypoints.openai.tools import ToolMode, parse_output, tool_schema

    mode = ToolMode("required", None, NO_PARAMETER_TOOLS)
    spec = StructuredOutputsParams(json=tool_schema(mode, parallel=True))
    (out,) = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                      SamplingParams(temperature=0, max_tokens=200, structured_outputs=spec),
                      use_tqdm=False)
    content, calls, finish = parse_output(mode, out.outputs[0].text,
                                          out.outputs[0].finish_reason)
    assert (content, finish) == (None, "tool_calls"), out.outputs[0].text
    assert [(c.function.name, c.function.arguments) for c in calls] == [("list_tables", "{}")]


BAD_SPECS = [
    ({"json": {"type": "nonsense"}},
     'structured_outputs.json cannot be compiled: Unsupported type "nonsense"'),
    ({"json": "{not json"}, ("structured_outputs.json is not valid JSON: Expecting property "
                             "name enclosed in double quotes: line 1 column 2 (char 1)")),
    ({"regex": "a(b"}, ("structured_outputs.regex cannot be compiled: Regex parsing error at "
                        "position 4: The parenthesis is not closed.")),
    ({"grammar": "root ::= undefined_rule"}, ("structured_outputs.grammar cannot be compiled: "
     'EBNF parser error at line 1, column 10: Rule "undefined_rule" is not defined')),
]


def test_bad_specs_raise_and_leave_others_running(tiny_llm, llm):
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": _chat(tok, "hi")}
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=_spec(*CASES[0]))
    (alone,) = tiny_llm.generate(prompt, params, use_tqdm=False)
    engine = tiny_llm.engine
    engine.add_request("good", prompt, params)
    engine.step()
    for kwargs, message in BAD_SPECS:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            engine.add_request("bad", prompt, bad)
        engine.step()
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"]
    assert done[0].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("kwargs", [{}, {"json": PERSON, "regex": "a"},
                                    {"choice": []}, {"choice": "yes"}])
def test_params_need_exactly_one_constraint(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_matcher_advanced_twice_is_caught(llm):
    engine = llm.engine
    (grammar,) = engine.structured_output.request_grammars(
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"])), 1)
    token = llm.get_tokenizer().encode("yes", add_special_tokens=False)[0]
    grammar.accept(token, 1)
    with pytest.raises(RuntimeError, match="out of step"):
        grammar.accept(token, 1)


@pytest.mark.parametrize("density", [0.999, 0.5, 0.002])
def test_bitmask_kernel_masks_exactly_the_disallowed_tokens(density):
    """Our CPU kernel against the bool mask the bits were packed from, for a dense and a
    restrictive grammar, a vocabulary ending in a partial word and a subset of rows."""
    from pagedserve.structured_output import GrammarBitmask, apply_grammar_bitmask

    gen = torch.Generator().manual_seed(0)
    batch, vocab, rows = 5, 32 * 40 + 7, [1, 3, 4]
    words = -(-vocab // 32)
    allowed = torch.rand(len(rows), words * 32, generator=gen) < density
    bits = (allowed.view(len(rows), words, 32).long() << torch.arange(32)).sum(-1)
    bitmask = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)  # as signed int32
    logits = torch.randn(batch, vocab, generator=gen)
    expected = logits.clone()
    for j, row in enumerate(rows):
        expected[row, ~allowed[j, :vocab]] = float("-inf")
    apply_grammar_bitmask(logits, GrammarBitmask(torch.tensor(rows), bitmask, [False] * 3))
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="bitmask covers"):
        apply_grammar_bitmask(logits, GrammarBitmask(torch.tensor(rows), bitmask[:, :-1],
                                                     [False] * 3))
