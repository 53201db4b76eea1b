"""Command line: ``python -m fewstep <command>``.

Commands: ``generate`` (one text-to-image sample, latent + per-stage timings), ``stream`` (causal video chunk by
chunk), ``queue`` (run a workflow on a ComfyUI server), ``plan`` (the cost bill of a configuration), ``worker``
(join a sequence-parallel worker pool), ``demo`` (the showcase on dummy weights). Each command lives in its own module and registers its arguments here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..engine.errors import FewStepError
from . import demo, generate, plan, queue, stream, worker

COMMANDS = {
    "generate": generate,
    "stream": stream,
    "queue": queue,
    "plan": plan,
    "worker": worker,
    "demo": demo,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fewstep", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return COMMANDS[args.command].run(args) or 0
    except FewStepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
