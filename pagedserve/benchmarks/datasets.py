"""Benchmark prompt sets: each request as token ids plus the number of tokens to generate.

``--dataset-name`` (vLLM's names where vLLM has one):

- ``random``: random token ids; lengths uniform in ``[L * (1 - r), L * (1 + r)]`` for
  ``L`` = ``--input-len`` / ``--output-len`` and ``r`` = ``--range-ratio``.
- ``sharegpt``: a ShareGPT-format JSON array (``conversations: [{from, value}, ...]``); the
  first human turn is the prompt, the reply after it (if any) sets the output length,
  else ``--output-len``. Default file: ``sharegpt_v3_filtered_500.json`` (no replies).
- ``mt-bench``: MT-Bench questions, output lengths from gpt-4o's answers; with
  ``--mt-bench-turns 2`` also the second turns, after the first question and gpt-4o's answer.
- ``alpaca-eval``: AlpacaEval instructions, output lengths from the reference outputs.
- ``workload``: JSON lines with ``prompt_token_ids`` (or ``prompt`` text) and
  ``max_tokens``; default ``smollm2_workload_64.jsonl``, the fixed workload the peer
  engines were measured on (token ids fed as they are, file order kept).
- ``copy-edit``: prompts whose answers copy from them, for n-gram speculation: half "quote
  the paragraph that says X" over a given text, half "rename this variable / fix this
  line" over given code, answered with the whole file; every paragraph to quote and every
  file is >= 128 tokens. Output length ``--output-len`` (default 192). Bundled with the
  package (``data/copy_edit_prompts.json``: texts and code written for it).

Chat prompts get the model's chat template. The files come from the shared data folder
(``../shared/data`` next to the repository, see its README), ``copy-edit``'s from the
package; ``--dataset-path`` names another file or folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
from dataclasses import dataclass

logger = logging.getLogger(__name__)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"

# dataset name -> default file name in the data folder
DEFAULT_FILES = {
    "sharegpt": "sharegpt_v3_filtered_500.json",
    "mt-bench": ("mt_bench_question.jsonl", "mt_bench_model_answer_gpt-4o.jsonl"),
    "alpaca-eval": "alpaca_eval_gpt4_1106_preview_model_outputs.json",
    "workload": "smollm2_workload_64.jsonl",
}
COPY_EDIT_FILE = pathlib.Path(__file__).resolve().parent / "data" / "copy_edit_prompts.json"
DATASET_NAMES = ["random", *DEFAULT_FILES, "copy-edit"]
DEFAULT_OUTPUT_LEN = 128
COPY_EDIT_OUTPUT_LEN = 192


@dataclass
class SampleRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASET_NAMES,
                   help="prompt set (see pagedserve/benchmarks/datasets.py)")
    g.add_argument("--dataset-path", default=None,
                   help="file (or folder holding the default file) of the prompt set "
                        f"(default: {DEFAULT_DATA_DIR} when present)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests to run (default: the whole file, in file order; 64 for "
                        "random); fewer than a file holds are a random sample (--seed), "
                        "except for workload (its first ones)")
    g.add_argument("--input-len", type=int, default=128, help="random: mean prompt length")
    g.add_argument("--output-len", type=int, default=None,
                   help=f"random: mean output length; others: output length of prompts "
                        f"without a reference reply (default: {DEFAULT_OUTPUT_LEN}; "
                        f"copy-edit: {COPY_EDIT_OUTPUT_LEN})")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)")
    g.add_argument("--max-output-len", type=int, default=None,
                   help="cap on reference output lengths (mt-bench, alpaca-eval, sharegpt, "
                        "workload)")
    g.add_argument("--mt-bench-turns", type=int, default=1, choices=[1, 2],
                   help="mt-bench: first turns only, or also the second turns")


def needs_tokenizer(dataset_name: str) -> bool:
    """Whether a set needs the tokenizer (chat template, reply lengths)."""
    return dataset_name in ("sharegpt", "mt-bench", "alpaca-eval", "copy-edit")


def resolve_path(dataset_name: str, dataset_path: str | None) -> pathlib.Path | tuple:
    """The file(s) of a file-backed set: ``dataset_path`` (a file, or a folder holding the
    default file name) or the shared data folder. Raises FileNotFoundError."""
    default = DEFAULT_FILES[dataset_name]
    base = pathlib.Path(dataset_path).expanduser() if dataset_path else DEFAULT_DATA_DIR
    if isinstance(default, tuple):  # mt-bench: questions + answers, in one folder
        folder = base.parent if base.is_file() else base
        paths = tuple(folder / name for name in default)
        if base.is_file():
            paths = (base, paths[1])
    else:
        paths = (base / default if base.is_dir() else base,)
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"{dataset_name} data file {str(path)!r} not found; pass --dataset-path")
    return paths if isinstance(default, tuple) else paths[0]


def get_samples(args: argparse.Namespace, tokenizer=None, vocab_size: int | None = None,
                max_model_len: int | None = None) -> list[SampleRequest]:
    """The requests named by the dataset flags (see ``add_dataset_args``)."""
    name, seed = args.dataset_name, getattr(args, "seed", 0)
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1; got {args.num_prompts}")
    if name == "random":
        if vocab_size is None:
            vocab_size = len(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        return random_samples(args.num_prompts or 64, args.input_len, output_len,
                              args.range_ratio, vocab_size, seed, special)
    if needs_tokenizer(name) and tokenizer is None:
        raise ValueError(f"dataset {name} needs a tokenizer")
    if name == "copy-edit":
        path = pathlib.Path(args.dataset_path).expanduser() if args.dataset_path \
            else COPY_EDIT_FILE
        samples = copy_edit_samples(path, tokenizer, args.output_len or COPY_EDIT_OUTPUT_LEN)
    else:
        samples = file_samples(name, args.dataset_path, tokenizer, output_len,
                               args.mt_bench_turns)
    if args.max_output_len is not None:
        for s in samples:
            s.expected_output_len = min(s.expected_output_len, args.max_output_len)
    samples = fit(samples, max_model_len)
    return select(samples, args.num_prompts, seed, sample=name != "workload")


def file_samples(name: str, dataset_path: str | None, tokenizer, output_len: int,
                 mt_bench_turns: int) -> list[SampleRequest]:
    """The requests of a set read from the shared data folder (or ``dataset_path``)."""
    path = resolve_path(name, dataset_path)
    if name == "sharegpt":
        return sharegpt_samples(path, tokenizer, output_len)
    if name == "mt-bench":
        return mt_bench_samples(*path, tokenizer, mt_bench_turns)
    if name == "alpaca-eval":
        return alpaca_eval_samples(path, tokenizer)
    return workload_samples(path)


def random_samples(num: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int, exclude: set[int] = frozenset()
                   ) -> list[SampleRequest]:
    """``num`` prompts of random token ids (avoiding ``exclude``, e.g. special tokens)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1); got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1; got {input_len}, {output_len}")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in exclude]

    def length(mean: int) -> int:
        lo = max(1, int(mean * (1 - range_ratio)))
        return rng.randint(lo, max(lo, int(mean * (1 + range_ratio))))

    lengths = [(length(input_len), length(output_len)) for _ in range(num)]
    return [SampleRequest([rng.choice(allowed) for _ in range(n_in)], n_out)
            for n_in, n_out in lengths]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the tokenizer's own chat template."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def _num_tokens(tokenizer, texts: list[str]) -> list[int]:
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def sharegpt_samples(path: pathlib.Path, tokenizer, output_len: int) -> list[SampleRequest]:
    """First human turn of each conversation; the reply after it sets the output length."""
    with open(path) as f:
        data = json.load(f)
    prompts, replies = [], []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        for i, turn in enumerate(conv):
            if turn.get("from") in ("human", "user"):
                prompts.append(turn["value"])
                nxt = conv[i + 1] if i + 1 < len(conv) else None
                replies.append(nxt["value"] if nxt and nxt.get("from") in ("gpt", "assistant",
                                                                          "chatgpt") else None)
                break
    lens = iter(_num_tokens(tokenizer, [r for r in replies if r is not None]))
    return [SampleRequest(chat_ids(tokenizer, [{"role": "user", "content": p}]),
                          next(lens) if r is not None else output_len)
            for p, r in zip(prompts, replies)]


def mt_bench_samples(question_path: pathlib.Path, answer_path: pathlib.Path, tokenizer,
                     turns: int = 1) -> list[SampleRequest]:
    """MT-Bench questions with gpt-4o's answer lengths as output lengths. Turn 2 prompts
    hold turn 1, gpt-4o's answer to it, and the follow-up question."""
    answers = {}
    with open(answer_path) as f:
        for line in f:
            if line.strip():
                a = json.loads(line)
                answers[a["question_id"]] = a["choices"][0]["turns"]
    samples = []
    with open(question_path) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    for q in questions:
        ans = answers.get(q["question_id"])
        if ans is None:
            continue
        lens = _num_tokens(tokenizer, ans[:turns])
        messages: list[dict] = []
        for t in range(turns):
            messages.append({"role": "user", "content": q["turns"][t]})
            samples.append(SampleRequest(chat_ids(tokenizer, messages), lens[t]))
            messages.append({"role": "assistant", "content": ans[t]})
    return samples


def alpaca_eval_samples(path: pathlib.Path, tokenizer) -> list[SampleRequest]:
    """AlpacaEval instructions; the reference output's length is the output length."""
    with open(path) as f:
        data = json.load(f)
    lens = _num_tokens(tokenizer, [d["output"] for d in data])
    return [SampleRequest(chat_ids(tokenizer, [{"role": "user", "content": d["instruction"]}]),
                          n) for d, n in zip(data, lens)]


def workload_samples(path: pathlib.Path, tokenizer=None) -> list[SampleRequest]:
    """JSON lines ``{"prompt_token_ids": [...], "max_tokens": N}`` (``prompt`` text is
    tokenized as it is when there are no ids)."""
    samples = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = rec.get("prompt_token_ids")
            if ids is None:
                if tokenizer is None or "prompt" not in rec:
                    raise ValueError(f"{path}:{n}: no prompt_token_ids")
                ids = tokenizer.encode(rec["prompt"], add_special_tokens=False)
            samples.append(SampleRequest(list(ids), int(rec.get("max_tokens",
                                                               DEFAULT_OUTPUT_LEN))))
    return samples


def copy_edit_prompts(path: pathlib.Path = COPY_EDIT_FILE) -> list[dict]:
    """The copy-edit prompts, quotes first: ``{"kind": "quote" | "code", "source": the
    paragraph to quote or the file to edit, "prompt": the user message}``.

    ``path`` holds ``{"quote": [{"title", "paragraphs", "quote_paragraph" (an index),
    "says"}, ...], "code": [{"language", "code" (lines), "request"}, ...]}``.
    """
    with open(path) as f:
        data = json.load(f)
    prompts = []
    for q in data["quote"]:
        text = "\n\n".join(q["paragraphs"])
        prompts.append({"kind": "quote", "source": q["paragraphs"][q["quote_paragraph"]],
                        "prompt": f'Here is a text titled "{q["title"]}".\n\n{text}\n\n'
                                  f'Quote, word for word, the paragraph that {q["says"]}. '
                                  f'Reply with that paragraph only, exactly as written.'})
    for c in data["code"]:
        code = "\n".join(c["code"])
        prompts.append({"kind": "code", "source": code,
                        "prompt": f'Here is a {c["language"]} file.\n\n'
                                  f'```{c["language"].lower()}\n{code}\n```\n\n'
                                  f'{c["request"]} Return the whole corrected file in one '
                                  f'code block, with every other line unchanged.'})
    return prompts


def copy_edit_samples(path: pathlib.Path, tokenizer, output_len: int) -> list[SampleRequest]:
    """The copy-edit prompts as chats, each generating ``output_len`` tokens."""
    return [SampleRequest(chat_ids(tokenizer, [{"role": "user", "content": p["prompt"]}]),
                          output_len) for p in copy_edit_prompts(path)]


def fit(samples: list[SampleRequest], max_model_len: int | None) -> list[SampleRequest]:
    """Drop requests with no output or that do not fit in ``max_model_len``."""
    kept = [s for s in samples if s.expected_output_len >= 1 and s.prompt_len >= 1
            and (max_model_len is None or s.prompt_len + s.expected_output_len <= max_model_len)]
    if len(kept) < len(samples):
        logger.warning("dropped %d of %d requests longer than max_model_len %s (or empty)",
                       len(samples) - len(kept), len(samples), max_model_len)
    if not kept:
        raise ValueError("no request of the dataset fits (max_model_len too small?)")
    return kept


def select(samples: list[SampleRequest], num: int | None, seed: int,
           sample: bool = True) -> list[SampleRequest]:
    """``num`` requests: all in file order (None), a random sample drawn with ``seed``
    (or the first ``num`` when not ``sample``), or the set repeated cyclically when it
    holds fewer."""
    if num is None:
        return list(samples)
    if num < len(samples):
        return random.Random(seed).sample(samples, num) if sample else samples[:num]
    if num > len(samples):
        logger.warning("the dataset has %d requests; repeating them to make %d",
                       len(samples), num)
    return [samples[i % len(samples)] for i in range(num)]


def summary(samples: list[SampleRequest]) -> dict:
    """Totals and ranges of prompt and output lengths."""
    p = [s.prompt_len for s in samples]
    o = [s.expected_output_len for s in samples]
    return {"num_requests": len(samples), "prompt_tokens": sum(p), "output_tokens": sum(o),
            "prompt_len_range": [min(p), max(p)], "output_len_range": [min(o), max(o)]}
