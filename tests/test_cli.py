"""The command line: ``--help`` answers without loading torch or the model code."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "pagedserve.models", "pagedserve.engine.llm_engine")


def imported_modules(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the CLI as ``python -X importtime -m pagedserve.entrypoints.cli ARGV`` and return
    the process and the names of every module it imported (from the importtime report)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m",
                           "pagedserve.entrypoints.cli", *argv],
                          check=False, capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    return proc, names


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["bench", "latency", "--help"]])
def test_help_does_not_import_torch(argv):
    proc, names = imported_modules(argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: pagedserve")
    assert "pagedserve.args" in names  # the report is really parsed
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY or n.startswith(HEAVY))
    assert heavy == [], heavy


def test_package_still_exports_llm():
    import pagedserve
    from pagedserve.entrypoints.llm import LLM

    assert pagedserve.LLM is LLM
    with pytest.raises(AttributeError):
        pagedserve.no_such_name  # noqa: B018


def _helps(parser) -> dict[str, str]:
    """``--help`` of ``parser`` and of every subcommand under it, by command line."""
    import argparse

    out = {parser.prog: parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _helps(sub)
    return out


def test_help_is_plain_text_with_one_default_style():
    """No reST markup in any --help (the bench summaries come from docstrings), and every
    default the help text states itself reads "(default: ...)", as argparse's own do."""
    import re

    from pagedserve.entrypoints.cli import build_parser

    helps = _helps(build_parser())
    assert len(helps) == 9  # pagedserve, serve, generate, chat, bench + 4 benchmarks
    bench = helps["pagedserve bench"]
    assert "throughput          offline throughput, all requests queued at once." in bench
    for prog, text in helps.items():
        assert "``" not in text, prog
        assert re.findall(r"\(default(?!:)", text) == [], prog


def test_readme_quotes_the_quantization_help():
    """README.md's Models section says of --quantization what `serve --help` says."""
    from pathlib import Path

    from pagedserve.args import QUANTIZATION_HELP

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    models = readme[readme.index("\n## Models\n"):readme.index("\n## Benchmarks\n")]
    assert f"`--quantization`: {QUANTIZATION_HELP}." in " ".join(models.split())
