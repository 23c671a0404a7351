"""pagedserve: serve an OpenAI-compatible API, generate, chat, or run benchmarks."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pagedserve.args import EngineArgs
from pagedserve.entrypoints.openai.cli_args import add_lora_server_args

# `pagedserve bench NAME` -> module with add_cli_args(parser) and main(args) -> exit code.
BENCHMARKS = {
    "memory": "pagedserve.benchmarks.memory",
    "throughput": "pagedserve.benchmarks.throughput",
    "latency": "pagedserve.benchmarks.latency",
    "serve": "pagedserve.benchmarks.serve",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones and where the help text already names one."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _summary(doc: str) -> str:
    """A benchmark's summary for ``bench --help``: its docstring's first line after the
    command's name, without reST markup."""
    return doc.splitlines()[0].partition(": ")[2].replace("``", "")


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory or .gguf file "
                             "(default: the bundled SmolLM2-135M-Instruct)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           formatter_class=_HelpFormatter)
    _add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="model name in the API (default: the model argument or its alias)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 endpoints and on "
                            "the dashboard's data")
    serve.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live page /dashboard (nor its data)")
    serve.add_argument("--chat-template", default=None,
                       help="chat template (a file, or the Jinja text itself) to use instead "
                            "of the model's, e.g. one that renders tools")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default when tools are given): '
                            "the model decides, --tool-call-parser finds its calls")
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                       help="how tool calls are found in the text under tool_choice auto "
                            "(hermes: <tool_call>{...}</tool_call> blocks, as Qwen2.5/Qwen3)")
    add_lora_server_args(serve)
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the HTTP server")
    EngineArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="complete one prompt and print the text",
                         formatter_class=_HelpFormatter)
    _add_model_arg(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the chat template")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal",
                          formatter_class=_HelpFormatter)
    _add_model_arg(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        p = bench_sub.add_parser(name, help=_summary(mod.__doc__),
                                 formatter_class=_HelpFormatter)
        mod.add_cli_args(p)
        p.set_defaults(bench_main=mod.main)
    return parser


def _sampling_params(args):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _make_llm(args):
    from pagedserve.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    return LLM(**{k: v for k, v in vars(engine_args).items()})


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args) -> int:
    from pagedserve.entrypoints.openai.api_server import run_server

    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    commands = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat,
                "bench": lambda a: a.bench_main(a)}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
