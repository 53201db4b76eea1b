"""The CLI's parser as a new user reads it: every flag explained with its default, one meaning per flag name,
the global flags accepted after the command."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import pytest

from fewstep.cli import COMMANDS, HelpFormatter, build_parser
from fewstep.engine.attention import BACKENDS


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def test_every_command_is_registered():
    assert set(_subparsers(build_parser())) == set(COMMANDS) == {
        "generate", "stream", "encode", "queue", "live", "plan", "worker", "demo",
    }  # fmt: skip


HELP_CHECKED = sorted(COMMANDS)


@pytest.mark.parametrize("command", HELP_CHECKED)
def test_every_flag_has_a_sentence_and_its_default(command):
    sub = _subparsers(build_parser())[command]
    formatter = HelpFormatter(prog="x")
    problems = []
    for action in _options(sub):
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        text = action.help or ""
        shown = formatter._get_help_string(action) % {**vars(action), "prog": "x"}
        if len(text.split()) < 3:
            problems.append(f"{flag}: no sentence ({text!r})")
        if "(default" not in shown and not (action.required and "(required)" in shown):
            problems.append(f"{flag}: no default in {shown!r}")
        if "default: None" in shown or "(default: )" in shown:
            problems.append(f"{flag}: the default says None instead of what decides it")
        if "``" in shown:
            problems.append(f"{flag}: reST markup in {shown!r}")
    assert problems == []


@pytest.mark.parametrize("command", HELP_CHECKED)
def test_help_text_renders_without_markup(command):
    text = _subparsers(build_parser())[command].format_help()
    assert "``" not in text and "default: None" not in text
    assert text.count("(default:") >= 1


# The one meaning of every flag that more than one command has (dest, type, unit). A new flag shared by two
# commands must be added here, which asks whether it means the same in both.
SHARED_MEANINGS = {
    "--model": "model preset",
    "--weights": "dummy or a checkpoint path",
    "--lora": "LoRA file[:strength], repeatable",
    "--dtype": "compute dtype",
    "--weight-dtype": "linear weight storage",
    "--device": "torch device",
    "--height": "px",
    "--width": "px",
    "--batch": "rows per job",
    "--sessions": "video streams in one session pool",
    "--steps": "denoising steps",
    "--schedule": "sigma schedule",
    "--cfg": "CFG scale",
    "--seed": "noise seed",
    "--text-tokens": "text tokens per prompt",
    "--cond": "conditioning safetensors",
    "--prompt": "prompt text, encoded with --text-encoder",
    "--text-encoder": "text encoder folder",
    "--max-sequence-length": "tokens per encoded prompt",
    "--latent-frames": "latent frames",
    "--chunk-frames": "latent frames per chunk",
    "--window-frames": "latent frames of the KV window",
    "--sink-frames": "latent frames kept forever",
    "--kv-dtype": "KV cache storage",
    "--keep-recent-chunks": "completed chunks kept unquantized",
    "--tiny-vae": "tiny AE weights",
    "--compile": "torch.compile mode",
    "--compile-backend": "torch.compile backend",
    "--cuda-graph": "CUDA graph mode",
    "--out": "output path: a folder (encode: the conditioning file)",
    "--json": "print the report as JSON",
    "--timeout": "seconds",
    "--server": "ComfyUI address",
    "--script": "control script",
    "--quiet": "no progress lines",
    "--verbose": "INFO logging",
    "--help": "help",
}


def test_a_flag_name_shared_by_commands_has_one_dest_and_type_everywhere():
    seen: dict[str, dict[str, tuple]] = {}
    helps: dict[str, list[str]] = {}
    for command, sub in _subparsers(build_parser()).items():
        for action in _options(sub):
            for flag in action.option_strings:
                # the argparse action it is (a store that also records that the flag was given is a store)
                kind = next(c for c in type(action).__mro__ if c.__module__ == "argparse").__name__
                seen.setdefault(flag, {})[command] = (action.dest, action.type, kind)
                helps.setdefault(flag, []).append(action.help or "")
    shared = {flag: uses for flag, uses in seen.items() if len(uses) > 1 and flag.startswith("--")}
    assert set(shared) <= set(SHARED_MEANINGS), sorted(set(shared) - set(SHARED_MEANINGS))
    for flag, uses in shared.items():
        if flag == "--timeout":  # queue bounds the whole command, worker the wait for the host: both seconds
            assert all("seconds" in text for text in helps[flag]), helps[flag]
            continue
        assert len(set(uses.values())) == 1, (flag, uses)


def test_the_model_flags_are_declared_once():
    """generate and stream take the model flags from one function (cli.common.add_model_arguments): the flags
    they share read the same, and --attention lists the engine's own backends."""
    subs = _subparsers(build_parser())

    def flags(command):
        return {a.option_strings[-1]: (a.default, a.choices, a.help) for a in _options(subs[command])}

    generate, stream = flags("generate"), flags("stream")
    for flag in ("--dtype", "--weight-dtype", "--device", "--lora"):
        assert generate[flag] == stream[flag], flag
    assert stream["--weights"][2].startswith(generate["--weights"][2])
    assert generate["--attention"][1] == list(BACKENDS)


def test_frames_name_one_unit():
    """--frames meant latent frames in stream and video frames in plan: each unit has its own name now."""
    subs = _subparsers(build_parser())
    for command in ("stream", "plan"):
        flags = {f for a in _options(subs[command]) for f in a.option_strings}
        assert "--latent-frames" in flags and "--frames" not in flags, command
    assert "--video-frames" in {f for a in _options(subs["plan"]) for f in a.option_strings}
    args = build_parser().parse_args(["stream", "--latent-frames", "6", "--keep-recent-chunks", "2"])
    assert (args.latent_frames, args.keep_recent_chunks) == (6, 2)


def test_old_spellings_are_deprecated_aliases(capsys):
    args = build_parser().parse_args(["stream", "--keep-recent", "3"])
    assert args.keep_recent_chunks == 3
    assert "--keep-recent is deprecated; use --keep-recent-chunks" in capsys.readouterr().err
    args = build_parser().parse_args(["plan", "--model", "wan-tiny", "--frames", "33"])
    assert args.video_frames == 33
    assert "--frames is deprecated; use --video-frames" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # stream's --frames was latent frames: no silent change of unit
        build_parser().parse_args(["stream", "--frames", "6"])
    assert "--frames was latent frames here; use --latent-frames 6" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_verbose_is_accepted_before_and_after_the_command(command):
    required = {
        "plan": ["--model", "flux-tiny"],
        "queue": ["workflow.json"],
        "live": ["--script", "s.json"],
    }.get(command, [])
    parser = build_parser()
    assert parser.parse_args([command, *required]).verbose is False
    assert parser.parse_args(["-v", command, *required]).verbose is True
    assert parser.parse_args([command, "-v", *required]).verbose is True
    assert parser.parse_args([command, *required, "--verbose"]).verbose is True


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_on_either_side_of_the_command_logs_at_info(where):
    """A real run: main() configures INFO logging from -v whichever side of the command name it is on."""
    argv = ["plan", "--model", "flux-tiny", "--height", "64", "--width", "64"]
    argv = ["-v", *argv] if where == "before" else [*argv[:1], "-v", *argv[1:]]
    code = (
        "import logging, sys\n"
        "from fewstep.cli import main\n"
        f"status = main({argv!r})\n"
        "print('LEVEL', status, logging.getLogger().level, file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert f"LEVEL 0 {logging.INFO}" in r.stderr
    quiet = subprocess.run(
        [sys.executable, "-c", code.replace("'-v', ", "")],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert f"LEVEL 0 {logging.WARNING}" in quiet.stderr


def test_plan_errors_name_the_video_frames_flag(capsys):
    """The engine's ``frames`` argument is plan's --video-frames (the one irregular name left in plan)."""
    from fewstep.cli import main

    assert main(["plan", "--model", "wan-tiny", "--video-frames", "80", "--no-vae"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: fewstep plan: input '--video-frames': 80 video frames: the Wan VAE makes 4k + 1"
    )
    assert main(["stream", "--kv-dtype", "int8", "--keep-recent", "9"]) == 2  # the old spelling, the new name
    err = capsys.readouterr().err
    assert "fewstep stream: input '--keep-recent-chunks': 9 recent chunks" in err


# -- choices: what each command accepts, and a wrong value in one line -----------------------------------------
def _run(capsys, *argv) -> tuple[int, list[str]]:
    from fewstep.cli import main

    status = main(list(argv))
    return status, capsys.readouterr().err.splitlines()


def test_each_command_lists_only_the_presets_it_runs():
    from fewstep.engine.models.registry import all_presets

    subs = _subparsers(build_parser())
    model = {
        c: next(a for a in _options(subs[c]) if "--model" in a.option_strings) for c in ("generate", "stream")
    }
    presets = all_presets()
    assert model["generate"].choices == sorted(n for n, (f, _) in presets.items() if f.is_image)
    assert model["stream"].choices == sorted(n for n, (f, _) in presets.items() if f.name == "wan")
    generate_help = subs["generate"].format_help()
    assert "wan-tiny" not in generate_help and "z-image-turbo" in generate_help
    assert "flux-tiny" not in subs["stream"].format_help()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["generate", "--model", "flux-tny"],
            "error: fewstep generate: input '--model': unknown 'flux-tny'; did you mean flux-tiny, flux2-tiny "
            "or flux2-tiny-dev?",
        ),
        (
            ["generate", "--model", "wan-tiny"],
            "error: fewstep generate: input '--model': wan-tiny is a wan video model, which "
            "`python -m fewstep stream --model wan-tiny` runs",
        ),
        (
            ["stream", "--model", "z-image-turbo"],
            "error: fewstep stream: input '--model': z-image-turbo is a zimage image model, which "
            "`python -m fewstep generate --model z-image-turbo` runs",
        ),
        (
            ["stream", "--model", "xyz"],
            "error: fewstep stream: input '--model': unknown 'xyz'; expected one of wan-mid, wan-tiny, "
            "wan2.1-1.3b, wan2.1-14b",
        ),
        (
            ["generate", "--decode", "tin"],
            "error: fewstep generate: input '--decode': unknown 'tin'; did you mean tiny?",
        ),
        (
            ["stream", "--rope", "absolut"],
            "error: fewstep stream: input '--rope': unknown 'absolut'; did you mean absolute?",
        ),
        (["generat"], "error: fewstep: input 'command': unknown 'generat'; did you mean generate?"),
        (  # plan's --model is free text (a 'dummy:' prefix is accepted): the same hint, from plan itself
            ["plan", "--model", "dummy:wan-tin"],
            "error: fewstep plan: input '--model': unknown model 'dummy:wan-tin'; did you mean wan-tiny or wan-mid?",
        ),
    ],
)
def test_a_value_outside_the_choices_is_one_line_with_the_closest(capsys, argv, expected):
    """Not argparse's whole usage followed by every choice: one line, the closest names (or all, when none is
    close), exit status 2."""
    status, err = _run(capsys, *argv)
    assert (status, err) == (2, [expected])


def test_stream_rope_help_says_keys_are_rotated_once_when_written():
    """Since the cache-relative RoPE change (engine/causal/kv_cache/layer.py: attend) a key is rotated once, when
    it is written, in both modes; nothing is rotated on the read."""
    rope = next(a for a in _options(_subparsers(build_parser())["stream"]) if "--rope" in a.option_strings)
    assert "rotate a key once, when it is written" in rope.help
    assert "unrotated and rotates" not in rope.help and "when read" not in rope.help
