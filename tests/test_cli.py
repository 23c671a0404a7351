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
