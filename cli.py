"""The ``kvserve`` command line: one parser that gathers every subcommand.

``serve`` comes from ``kvserve.service.cli``, ``generate`` / ``chat`` / ``stats`` from
``kvserve.clients.commands``, ``bench`` from ``kvserve.benchmarks.serving`` and ``worker`` from
``kvserve.engine.worker``. This module is the only place that imports all of them, so the
service, the clients and the benchmarks never import one another for the command line's sake.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvserve.clients.commands import add_client_commands
from kvserve.service.cli import add_serve_command

# subcommands whose own parsers own every flag (-h included); the rest of argv goes to them
PASS_THROUGH = ("worker", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="an LLM inference service over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_command(sub)
    worker = sub.add_parser("worker", add_help=False,
                            help="tensor-parallel workers of a further machine (see `kvserve worker -h`)")
    worker.add_argument("args", nargs=argparse.REMAINDER)
    worker.set_defaults(func=cmd_worker)
    add_client_commands(sub)
    bench = sub.add_parser("bench", add_help=False, help="serving benchmark (see `kvserve bench -h`)")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    for name, subparser in sub.choices.items():
        if name not in PASS_THROUGH:
            subparser.set_defaults(subparser=subparser)  # for errors that need the subcommand's usage
    return parser


def cmd_worker(args: argparse.Namespace) -> int:
    from kvserve.engine.worker import main as worker_main

    return worker_main(args.args)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.serving import main as bench_main

    return bench_main(args.args)


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
        return build_parser().parse_args(argv[:1]).func(argparse.Namespace(args=argv[1:]))
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported by the subcommand, whose usage lists the flags it takes
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
