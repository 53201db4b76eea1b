"""Command line: ``python -m fewstep <command>``.

Commands: ``generate`` (one text-to-image sample, latent + per-stage timings), ``stream`` (causal video chunk by
chunk), ``queue`` (run a workflow on a ComfyUI server), ``encode`` (a text prompt into a --cond file), ``live`` (drive a session of a live node with a control
script), ``plan`` (the cost bill of a configuration), ``worker``
(join a sequence-parallel worker pool), ``demo`` (the showcase on dummy weights). Each command lives in its own
module and registers its arguments here; a run imports only the module of the command it names (the whole set
for ``--help`` and for a command line that names none).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Mapping

from ..engine.errors import FewStepError, InputError
from .common import did_you_mean

COMMAND_NAMES = ("generate", "stream", "encode", "queue", "live", "plan", "worker", "demo")


class _Commands(Mapping):
    """Command name -> its module (``fewstep.cli.<name>``), imported when first asked for: each command module
    imports the parts of the engine it runs, and a command's start-up should not pay for the others'."""

    def __getitem__(self, name: str):
        if name not in COMMAND_NAMES:
            raise KeyError(name)
        return importlib.import_module(f"{__name__}.{name}")

    def __iter__(self):
        return iter(COMMAND_NAMES)

    def __len__(self) -> int:
        return len(COMMAND_NAMES)


COMMANDS = _Commands()

# Engine argument names whose flag is not simply ``--`` + the name with dashes, per command. Every other engine
# argument maps to the command's option of that name when it has one (``window_frames`` -> ``--window-frames``).
IRREGULAR_FLAGS = {
    "generate": {
        "custom_sigmas": "--sigmas",
        "positive": "--cond",
        "negative": "--negative-seed",
        "latent": "--height/--width/--batch",
        "backend": "--compile-backend",
    },
    "stream": {
        "context": "--cond",
        "backend": "--compile-backend",
        "start_latent": "--init-latents",
        "input_video": "--input-video",
    },  # fmt: skip
    "plan": {"frames": "--video-frames"},
}

DESCRIPTION = "FewStep: few-step image and causal video sampling, on dummy weights or checkpoints."


def global_arguments(defaults: bool) -> argparse.ArgumentParser:
    """The flags every command takes, before or after the command's name (``fewstep plan -v`` as ``fewstep -v
    plan``). The sub-commands' copy has no defaults (SUPPRESS), so a flag given before the command is not reset
    by the sub-parser, which fills its defaults into the same namespace."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="log at INFO level and print the traceback of an internal error (default: off)",
    )
    return parent


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (argparse's ArgumentDefaultsHelpFormatter), unless the help
    already gives it in words, "(default: ...)" (a default of None means "decided at run time": the help says
    by what); a required option has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "(default" in text
            or action.default is argparse.SUPPRESS
            or action.required
            or not action.option_strings
        ):
            return text
        if isinstance(action, argparse._StoreTrueAction) and action.default is False:
            return f"{text} (default: off)"
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with a value outside an option's choices said in one line (the closest names, or all of them
    when none is close) instead of the whole usage followed by every choice."""

    def _check_value(self, action, value):
        if action.choices is None or value in action.choices:
            return
        where = self.prog.removeprefix("python -m ")
        name = action.option_strings[-1] if action.option_strings else action.dest
        # main() prints it as every other bad input: one line, exit status 2
        raise InputError(name, choice_problem(action, value), where)


def choice_problem(action: argparse.Action, value: str) -> str:
    """Why ``value`` is not one of ``action``'s choices: the choice it belongs to elsewhere (an action's
    ``elsewhere``: value -> hint, e.g. a video preset given to an image command), else the closest choices."""
    elsewhere = getattr(action, "elsewhere", {}).get(value)
    if elsewhere:
        return elsewhere
    choices = [str(c) for c in action.choices]
    hint = did_you_mean(str(value), choices)
    return f"unknown {value!r}; {hint or 'expected one of ' + ', '.join(choices)}"


def _flags_of(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """dest -> long option of one sub-command (``window_frames`` -> ``--window-frames``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {
        a.dest: a.option_strings[-1]
        for a in sub._actions
        if a.option_strings and a.dest != "help" and a.help is not argparse.SUPPRESS  # not an old spelling
    }


def as_flag_error(err: InputError, command: str, flags: dict[str, str]) -> InputError:
    """The engine's error, naming the command's flag instead of the engine argument (the one mapping)."""
    name = err.input_name
    if not name.startswith("-"):
        name = IRREGULAR_FLAGS.get(command, {}).get(name) or flags.get(name, name)
    err.input_name = name
    err.where = f"fewstep {command}"
    err.args = (str(err),)
    return err


def named_command(argv: list[str]) -> str | None:
    """The command a command line names (its first word that is not an option: the global options take no value),
    or None when it names none or asks for the overall help."""
    for word in argv:
        if word in ("-h", "--help"):
            return None
        if not word.startswith("-"):
            return word if word in COMMAND_NAMES else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=named_command(argv))
    try:
        args = parser.parse_args(argv)
    except InputError as err:  # a value outside an option's choices (Parser)
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return COMMANDS[args.command].run(args) or 0
    except InputError as err:
        print(f"error: {as_flag_error(err, args.command, _flags_of(parser, args.command))}", file=sys.stderr)
        return 2
    except FewStepError as err:
        print(f"error: fewstep {args.command}: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a bug or an environment failure: one line, the details on -v
        if args.verbose:
            traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0]
        hint = "" if args.verbose else " (an internal error; -v shows the traceback)"
        print(f"error: fewstep {args.command}: {type(err).__name__}: {first}{hint}", file=sys.stderr)
        return 1


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` the global options and that one command (the only module imported)."""
    parser = Parser(
        prog="python -m fewstep",
        description=DESCRIPTION,
        parents=[global_arguments(defaults=True)],
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    after = global_arguments(defaults=False)
    for name in COMMAND_NAMES if only is None else (only,):
        module = COMMANDS[name]
        module.add_arguments(
            sub.add_parser(
                name,
                help=module.HELP,
                description=getattr(module, "DESCRIPTION", module.HELP),
                parents=[after],
                formatter_class=HelpFormatter,
            )
        )
    return parser
