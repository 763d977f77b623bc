"""The ``kvserve`` command line (also ``python -m kvserve``): one parser that gathers every subcommand.

``serve`` comes from ``kvserve.service.cli``, ``generate`` / ``chat`` / ``stats`` from
``kvserve.clients.commands``, and the pass-through commands from the modules in ``PASS_THROUGH``:
``bench`` (the serving benchmark), ``worker`` (tensor-parallel workers) and ``engine-core`` (the
engine-core process the server starts). This module is the only place that imports all of them, so
the service, the clients and the benchmarks never import one another for the command line's sake.
The engine's child processes are started by these names (``python -m kvserve worker|engine-core``),
which stay when a file moves; a pass-through command imports only its own module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommands whose own parsers own every flag (-h included): the rest of argv goes to the
# ``main(argv)`` of their module, imported only then
PASS_THROUGH = {
    "worker": ("kvserve.engine.executor.worker",
               "tensor-parallel workers of a further machine (see `kvserve worker -h`)"),
    "bench": ("kvserve.benchmarks.serving.bench", "serving benchmark (see `kvserve bench -h`)"),
    "engine-core": ("kvserve.engine.core.core_process", None),  # started by the server: not listed
    "grammar-compiler": ("kvserve.engine.structured.compile_worker", None),  # started by the engine
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="an LLM inference service over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from kvserve.clients.commands import add_client_commands
    from kvserve.service.cli import add_serve_command

    add_serve_command(sub)
    for name, (_, help_text) in PASS_THROUGH.items():
        if help_text is not None:  # listed in `kvserve -h`; _run dispatches all of them before parsing
            listed = sub.add_parser(name, add_help=False, help=help_text)
            listed.add_argument("args", nargs=argparse.REMAINDER)
    add_client_commands(sub)
    for name, subparser in sub.choices.items():
        if name not in PASS_THROUGH:
            subparser.set_defaults(subparser=subparser)  # for errors that need the subcommand's usage
    return parser


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C ends any command quietly (status 130); so does a closed pipe (``| head``)."""
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader is gone: point stdout at /dev/null so that the interpreter's final
        # flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv: list[str]) -> int:
    if argv and argv[0] in PASS_THROUGH:
        return importlib.import_module(PASS_THROUGH[argv[0]][0]).main(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported by the subcommand, whose usage lists the flags it takes
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
