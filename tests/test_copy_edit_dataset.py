"""The copy-edit benchmark set (issue 29): prompts whose answers copy from them.

Loaded with the bundled tokenizer: at least 20 prompts, as many quotes as code edits,
every paragraph to quote and every file to edit >= 128 tokens and present in the
chat-templated prompt; output length 192 unless ``--output-len`` says otherwise.
"""

from __future__ import annotations

import argparse

import pytest

from pagedserve.benchmarks import datasets
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def dataset_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    datasets.add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(["--dataset-name", "copy-edit", *argv])


def test_prompts_hold_long_copyable_sources(tokenizer):
    prompts = datasets.copy_edit_prompts()
    kinds = [p["kind"] for p in prompts]
    assert len(prompts) >= 20
    assert kinds.count("quote") == kinds.count("code") == len(prompts) // 2
    sources = [p["source"] for p in prompts]
    lengths = [len(ids) for ids in tokenizer(sources, add_special_tokens=False)["input_ids"]]
    assert min(lengths) >= 128, lengths
    for p in prompts:
        assert p["source"] in p["prompt"]


def test_samples_are_chats_with_output_len(tokenizer):
    prompts = datasets.copy_edit_prompts()
    samples = datasets.get_samples(dataset_args(), tokenizer)
    assert len(samples) == len(prompts)
    assert {s.expected_output_len for s in samples} == {192}
    for prompt, sample in zip(prompts, samples):
        assert prompt["source"] in tokenizer.decode(sample.prompt_token_ids)
    longer = datasets.get_samples(dataset_args("--output-len", "300", "--num-prompts", "4"),
                                  tokenizer)
    assert len(longer) == 4 and {s.expected_output_len for s in longer} == {300}


def test_needs_a_tokenizer():
    assert datasets.needs_tokenizer("copy-edit")
    with pytest.raises(ValueError, match="tokenizer"):
        datasets.get_samples(dataset_args())
