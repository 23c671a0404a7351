"""Seconds from starting ``pagedserve serve`` to its first chat answer (issue 13, target 6).

    python benchmarks/first_answer.py [--port 8123] [-- SERVE_ARGS...]

Starts the server (the bundled model unless SERVE_ARGS say otherwise), polls an 8-token
chat request every 50 ms until one answers, prints the time and the answer, stops it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("serve_args", nargs="*", help="more `pagedserve serve` arguments")
    args = parser.parse_args()
    start = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(args.port),
         *args.serve_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{args.port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with {server.returncode}")
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.load(response)
                break
            except OSError:  # not listening yet
                time.sleep(0.05)
        seconds = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(60)
    print(f"first answer after {seconds:.2f} s: "
          f"{answer['choices'][0]['message']['content']!r}")


if __name__ == "__main__":
    main()
