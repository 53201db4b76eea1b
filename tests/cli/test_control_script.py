"""The control-script format (cli/control_script.py): what a valid script reads as, and every refusal as one
message naming the flag, the file and the field."""

from __future__ import annotations

import json

import pytest

from fewstep.cli.control_script import MAX_CONTROLS, ControlScript, ScriptControl, read_script
from fewstep.engine.errors import InputError

EXAMPLE = {
    "prompt": "a red fox running through snow",
    "seed": 3,
    "chunks": 6,
    "start_image": None,
    "strength": None,
    "controls": [
        {"chunk": 2, "prompt": "a red fox running through a forest", "recache": True},
        {"chunk": 3, "prompt": "a red fox at night"},
        {"chunk": 4, "seed": 11},
        {"chunk": 5, "stop": True},
    ],
}


def _write(tmp_path, data, name="s.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_the_contract_example_reads_as_written(tmp_path):
    path = _write(tmp_path, EXAMPLE)
    script = read_script(path)
    assert script == ControlScript(
        path, "a red fox running through snow", 3, 6, None, None, None,
        (
            ScriptControl(2, "prompt", "a red fox running through a forest", True, 0),
            ScriptControl(3, "prompt", "a red fox at night", False, 1),
            ScriptControl(4, "seed", 11, False, 2),
            ScriptControl(5, "stop", True, False, 3),
        ),
    )  # fmt: skip
    assert script.stop_chunk == 5 and script.chunks_to_run == 5
    assert script.controls_at(2) == [script.controls[0]] and script.controls_at(5) == []
    assert [c.body() for c in script.controls[:3]] == [
        {"prompt": "a red fox running through a forest", "recache": True},
        {"prompt": "a red fox at night", "recache": False},
        {"seed": 11},
    ]


def test_defaults_and_relative_paths(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "start.png").write_bytes(b"x")
    (tmp_path / "frames").mkdir()
    path = _write(
        tmp_path,
        {"prompt": "p", "start_image": "img/start.png", "input_video": "frames", "strength": 1,
         "controls": [{"chunk": 0, "strength": None}, {"chunk": 1, "strength": 0.25}]},
    )  # fmt: skip
    script = read_script(path)
    assert script.seed == 0 and script.chunks is None and script.chunks_to_run is None
    assert script.start_image == str(tmp_path / "img" / "start.png")
    assert script.input_video == str(tmp_path / "frames") and script.strength == 1.0
    assert [c.value for c in script.controls] == [None, 0.25]


REFUSALS = [
    ("[]", 'expected a JSON object {"prompt": ..., "chunks": ..., ...}, got []'),
    ('{"prompt": ', "not JSON (Expecting value at line 1 column 12)"),
    ('{"prompt": "a", "prompt": "b"}', "the key 'prompt' is given twice in one object"),
    ({"prompt": "a", "seeds": 1}, "unknown key 'seeds'; did you mean seed?"),
    (
        {"prompt": "a", "zzz": 1},
        "unknown key 'zzz'; expected prompt, seed, chunks, start_image, strength, input_video, controls",
    ),
    ({"seed": 1}, "'prompt' is missing: the text the session starts with"),
    ({"prompt": ""}, "'prompt' must be text of 1..2000 characters, got 0 characters"),
    ({"prompt": "x" * 2001}, "'prompt' must be text of 1..2000 characters, got 2001 characters"),
    ({"prompt": "   "}, "'prompt' must be text of 1..2000 characters, got only white space"),
    ({"prompt": 3}, "'prompt' must be text of 1..2000 characters, got 3"),
    ({"prompt": "a", "seed": -1}, "'seed' must be an integer from 0 to 2^63 - 1, got -1"),
    ({"prompt": "a", "seed": 2**63}, f"'seed' must be an integer from 0 to 2^63 - 1, got {2**63}"),
    ({"prompt": "a", "seed": "3"}, "'seed' must be an integer from 0 to 2^63 - 1, got \"3\""),
    ({"prompt": "a", "seed": True}, "'seed' must be an integer from 0 to 2^63 - 1, got true"),
    ({"prompt": "a", "chunks": 0}, "'chunks' must be an integer >= 1, got 0"),
    ({"prompt": "a", "chunks": 2.0}, "'chunks' must be an integer >= 1, got 2.0"),
    (
        {"prompt": "a", "start_image": "a.gif"},
        "'start_image' must be the path of a PNG or JPEG file (.png, .jpg, .jpeg), got \"a.gif\"",
    ),
    ({"prompt": "a", "start_image": 1}, "'start_image' must be the path of a PNG or JPEG file, got 1"),
    (
        {"prompt": "a", "strength": 0.5},
        "'strength' restyles an input video: give 'input_video' too (a folder of frames or an mp4)",
    ),
    ({"prompt": "a", "strength": 0, "input_video": "."}, "'strength' must be a number in (0, 1], got 0"),
    ({"prompt": "a", "strength": 1.5, "input_video": "."}, "'strength' must be a number in (0, 1], got 1.5"),
    (
        {"prompt": "a", "input_video": "."},
        "'input_video' needs 'strength': the share of noise in (0, 1] each input chunk is restyled from",
    ),
    ({"prompt": "a", "input_video": "clip.txt", "strength": 0.5}, None),  # no such file: checked below
    ({"prompt": "a", "controls": {}}, "'controls' must be a list of objects, got {}"),
    (
        {"prompt": "a", "controls": [{"chunk": 0, "seed": 1}] * (MAX_CONTROLS + 1)},
        f"'controls' holds {MAX_CONTROLS + 1} controls; a script takes at most {MAX_CONTROLS}",
    ),
    (
        {"prompt": "a", "controls": [3]},
        'controls[0]: must be an object {"chunk": ..., one of prompt, strength, seed, stop}, got 3',
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "seed": 2}, {"chunk": -1, "seed": 1}]},
        "controls[1]: 'chunk' must be an integer >= 0, got -1",
    ),
    (
        {"prompt": "a", "controls": [{"seed": 1}]},
        "controls[0]: 'chunk' is missing: the chunk the control takes effect at (an integer >= 0)",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "sead": 1}]},
        "controls[0]: unknown key 'sead'; did you mean seed?",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1}]},
        "controls[0]: expected exactly one of 'prompt', 'strength', 'seed', 'stop', got none",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "seed": 1, "prompt": "b"}]},
        "controls[0]: expected exactly one of 'prompt', 'strength', 'seed', 'stop', got 'prompt' and 'seed'",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "seed": 1, "recache": True}]},
        "controls[0]: 'recache' goes "
        "with a 'prompt' control only (a re-cache recomputes the window under a new prompt)",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "prompt": "b", "recache": 1}]},
        "controls[0]: 'recache' must be true or false, got 1",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "prompt": ""}]},
        "controls[0]: 'prompt' must be text of 1..2000 characters, got 0 characters",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "strength": 2}]},
        "controls[0]: 'strength' must be a number in (0, 1] or null (back to text to video), got 2",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "seed": -3}]},
        "controls[0]: 'seed' must be an integer from 0 to 2^63 - 1, got -3",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "stop": False}]},
        "controls[0]: 'stop' must be true, got false",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 0, "stop": True}]},
        "controls[0]: a stop at chunk 0 would end the session before its first chunk; 'chunk' must be >= 1",
    ),
    (
        {"prompt": "a", "chunks": 4, "controls": [{"chunk": 4, "seed": 1}]},
        "controls[0]: 'chunk' 4 is past the session's 4 chunks (0 to 3)",
    ),
    (
        {"prompt": "a", "chunks": 4, "controls": [{"chunk": 5, "stop": True}]},
        "controls[0]: 'chunk' 5 is past the session's 4 chunks (0 to 4)",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 2, "stop": True}, {"chunk": 2, "seed": 1}]},
        "controls[1]: chunk 2 comes at or after the stop at chunk 2 (controls[0])",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 3, "seed": 1}, {"chunk": 2, "stop": True}]},
        "controls[1]: the stop at chunk 2 comes at or before controls[0] (chunk 3)",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 2, "stop": True}, {"chunk": 3, "stop": True}]},
        "controls[1]: chunk 3 comes at or after the stop at chunk 2 (controls[0])",
    ),
    (
        {"prompt": "a", "controls": [{"chunk": 1, "prompt": "b"}, {"chunk": 1, "prompt": "c"}]},
        "controls[1]: chunk 1 already has a prompt control (controls[0]); one control of a kind a chunk",
    ),
]


@pytest.mark.parametrize("data, problem", REFUSALS)
def test_every_refusal_is_one_message_naming_the_file_and_the_field(tmp_path, data, problem):
    path = _write(tmp_path, data)
    with pytest.raises(InputError) as info:
        read_script(path, "--script")
    if problem is None:
        problem = f"'input_video': no file or folder {tmp_path / 'clip.txt'}"
    assert str(info.value) == f"input '--script': {path}: {problem}"
    assert "\n" not in str(info.value)


def test_chunks_are_required_when_the_command_needs_them(tmp_path):
    path = _write(tmp_path, {"prompt": "a"})
    with pytest.raises(InputError, match="'chunks' is missing: the number of chunks the session makes"):
        read_script(path, require_chunks=True)


def test_a_missing_file_an_oversized_file_and_missing_media(tmp_path):
    with pytest.raises(InputError, match=r"nope.json: cannot read it \(No such file or directory\)"):
        read_script(str(tmp_path / "nope.json"))
    big = _write(tmp_path, " " * ((1 << 20) + 1), "big.json")
    with pytest.raises(
        InputError, match=r"big.json: 1048577 bytes; a control script is at most 1048576 bytes"
    ):
        read_script(big)
    path = _write(tmp_path, {"prompt": "a", "start_image": "start.png"})
    with pytest.raises(InputError) as info:
        read_script(path)
    assert str(info.value).endswith(f"'start_image': no file {tmp_path / 'start.png'}")
    mp4 = _write(tmp_path, {"prompt": "a", "input_video": "in.gif", "strength": 0.5})
    (tmp_path / "in.gif").write_bytes(b"x")
    with pytest.raises(
        InputError, match=r"'input_video' must be a folder of PNG/JPEG frames or a video file"
    ):
        read_script(mp4)


def test_an_absolute_path_is_kept(tmp_path):
    image = tmp_path / "elsewhere.jpg"
    image.write_bytes(b"x")
    sub = tmp_path / "scripts"
    sub.mkdir()
    path = _write(sub, {"prompt": "a", "start_image": str(image)})
    assert read_script(path).start_image == str(image)
