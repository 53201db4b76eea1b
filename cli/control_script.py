"""The control-script format: one JSON file describes one video session and what its client does to it between
chunks. ``stream --script FILE`` runs it in the engine, ``live --script FILE`` drives a FewStep Live Video node
with it, so a live run and an engine run of the same script can be compared latent for latent.

```json
{"prompt": "a red fox running through snow", "seed": 3, "chunks": 6,
 "start_image": null, "strength": null, "input_video": null,
 "controls": [
   {"chunk": 2, "prompt": "a red fox running through a forest", "recache": true},
   {"chunk": 3, "prompt": "a red fox at night"},
   {"chunk": 4, "seed": 11},
   {"chunk": 5, "stop": true}
 ]}
```

A control with ``"chunk": k`` takes effect at the boundary before chunk ``k`` (chunk ``k`` is the first one made
under it). ``stop`` ends the session there: chunks ``0 .. k - 1`` are made. Paths are relative to the script's
folder (or absolute). Every problem is one :class:`InputError` naming the flag, the file and the field
(``--script a.json: controls[1]: 'chunk' must be an integer >= 0, got -1``); nothing is loaded before the whole
script is checked.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from ..engine.errors import InputError
from .common import did_you_mean

MAX_SCRIPT_BYTES = (
    1 << 20
)  # a script is a few hundred bytes; 64 controls of 2000-character prompts fit easily
MAX_PROMPT_CHARS = 2000
MAX_CONTROLS = 64
SEED_LIMIT = 2**63 - 1  # what the live routes take (JSON integers a server stores as int64)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi")
TOP_KEYS = ("prompt", "seed", "chunks", "start_image", "strength", "input_video", "controls")
CONTROL_KINDS = ("prompt", "strength", "seed", "stop")
CONTROL_KEYS = ("chunk", *CONTROL_KINDS, "recache")


@dataclass(frozen=True)
class ScriptControl:
    """One control of a script: ``kind`` (prompt / strength / seed / stop) and its value, sent before chunk
    ``chunk``; ``index`` is its place in the script's ``controls`` (for messages)."""

    chunk: int
    kind: str
    value: object  # prompt: text; strength: float or None (back to text to video); seed: int; stop: True
    recache: bool = False
    index: int = 0

    def body(self) -> dict:
        """The control as the live routes take it (``POST .../control``), without ``at_chunk``."""
        if self.kind == "prompt":
            return {"prompt": self.value, "recache": self.recache}
        return {self.kind: self.value}


@dataclass(frozen=True)
class ControlScript:
    path: str
    prompt: str
    seed: int = 0
    chunks: int | None = None  # as written; ``chunks_to_run`` applies a stop
    start_image: str | None = None  # resolved path
    strength: float | None = None
    input_video: str | None = None  # resolved path
    controls: tuple[ScriptControl, ...] = ()

    @property
    def stop_chunk(self) -> int | None:
        return next((c.chunk for c in self.controls if c.kind == "stop"), None)

    @property
    def chunks_to_run(self) -> int | None:
        """The chunks the session makes: ``chunks``, or fewer when a stop comes first (None: neither given)."""
        stops = [n for n in (self.chunks, self.stop_chunk) if n is not None]
        return min(stops) if stops else None

    def controls_at(self, chunk: int) -> list[ScriptControl]:
        """The controls (stop excluded) sent before chunk ``chunk``, in the script's order."""
        return [c for c in self.controls if c.chunk == chunk and c.kind != "stop"]


def _refuse(path: str, where: str, problem: str, flag: str) -> InputError:
    return InputError(flag, f"{path}: {where + ': ' if where else ''}{problem}")


def _shown(value) -> str:
    """A value as the script wrote it (JSON), shortened: "3" apart from 3, null for None."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _DuplicateKeyError(key)
    return dict(pairs)


class _DuplicateKeyError(ValueError):
    def __init__(self, key):
        super().__init__(key)
        self.key = key


def read_script(path: str, flag: str = "--script", require_chunks: bool = False) -> ControlScript:
    """The script in ``path``, checked whole; raises InputError(``flag``, "PATH: FIELD: problem")."""
    try:
        size = os.path.getsize(path)
        if size > MAX_SCRIPT_BYTES:
            raise _refuse(
                path, "", f"{size} bytes; a control script is at most {MAX_SCRIPT_BYTES} bytes", flag
            )
        with open(path, "rb") as f:
            raw = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as exc:
        raise _refuse(path, "", f"cannot read it ({exc.strerror or exc})", flag) from None
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKeyError as dup:
        raise _refuse(path, "", f"the key {dup.key!r} is given twice in one object", flag) from None
    except RecursionError:
        raise _refuse(path, "", "JSON nested too deeply for a control script", flag) from None
    except UnicodeDecodeError:
        raise _refuse(path, "", "not UTF-8 text", flag) from None
    except json.JSONDecodeError as exc:
        raise _refuse(
            path, "", f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", flag
        ) from None
    return parse_script(data, path, flag, require_chunks)


def parse_script(data, path: str, flag: str = "--script", require_chunks: bool = False) -> ControlScript:
    """A script's parsed JSON checked (``path`` names it in messages and anchors its relative paths)."""

    def refuse(where: str, problem: str) -> InputError:
        return _refuse(path, where, problem, flag)

    if not isinstance(data, dict):
        raise refuse("", f'expected a JSON object {{"prompt": ..., "chunks": ..., ...}}, got {_shown(data)}')
    for key in data:
        if key not in TOP_KEYS:
            hint = did_you_mean(key, list(TOP_KEYS))
            raise refuse("", f"unknown key {key!r}; {hint or 'expected ' + ', '.join(TOP_KEYS)}")
    if "prompt" not in data:
        raise refuse("", "'prompt' is missing: the text the session starts with")
    prompt = check_prompt(data["prompt"], "prompt", refuse)
    seed = check_seed_value(data.get("seed", 0), "seed", refuse)
    chunks = data.get("chunks")
    if chunks is None:
        if require_chunks:
            raise refuse("", "'chunks' is missing: the number of chunks the session makes (an integer >= 1)")
    elif not _is_int(chunks) or chunks < 1:
        raise refuse("", f"'chunks' must be an integer >= 1, got {_shown(chunks)}")
    folder = os.path.dirname(os.path.abspath(path))
    start_image = _file(
        data.get("start_image"), "start_image", folder, refuse, IMAGE_EXTENSIONS, "a PNG or JPEG"
    )
    strength = data.get("strength")
    if strength is not None:
        strength = check_strength_value(strength, "strength", refuse, allow_none=False)
    input_video = data.get("input_video")
    if input_video is not None:
        input_video = _video(input_video, folder, refuse)
    if strength is not None and input_video is None:
        raise refuse(
            "", "'strength' restyles an input video: give 'input_video' too (a folder of frames or an mp4)"
        )
    if input_video is not None and strength is None:
        raise refuse("", "'input_video' needs 'strength': the share of noise in (0, 1] each input chunk is restyled "
                     "from")  # fmt: skip
    controls = _controls(data.get("controls", []), chunks, input_video is not None, refuse)
    return ControlScript(path, prompt, seed, chunks, start_image, strength, input_video, controls)


def check_prompt(value, field: str, refuse) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_PROMPT_CHARS or not value.strip():
        got = f"{len(value)} characters" if isinstance(value, str) else _shown(value)
        if isinstance(value, str) and value and not value.strip():
            got = "only white space"
        raise refuse("", f"'{field}' must be text of 1..{MAX_PROMPT_CHARS} characters, got {got}")
    return value


def check_seed_value(value, field: str, refuse) -> int:
    if not _is_int(value) or not 0 <= value <= SEED_LIMIT:
        raise refuse("", f"'{field}' must be an integer from 0 to 2^63 - 1, got {_shown(value)}")
    return value


def check_strength_value(value, field: str, refuse, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1
    )
    if not ok:
        also = " or null (back to text to video)" if allow_none else ""
        raise refuse("", f"'{field}' must be a number in (0, 1]{also}, got {_shown(value)}")
    return float(value)


def _file(value, field: str, folder: str, refuse, extensions, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise refuse("", f"'{field}' must be the path of {what} file, got {_shown(value)}")
    resolved = os.path.join(folder, value)
    if os.path.splitext(value)[1].lower() not in extensions:
        raise refuse(
            "", f"'{field}' must be the path of {what} file ({', '.join(extensions)}), got {_shown(value)}"
        )
    if not os.path.isfile(resolved):
        raise refuse("", f"'{field}': no file {resolved}")
    return resolved


def _video(value, folder: str, refuse) -> str:
    if not isinstance(value, str) or not value:
        raise refuse(
            "", f"'input_video' must be the path of a folder of frames or a video file, got {_shown(value)}"
        )
    resolved = os.path.join(folder, value)
    if os.path.isdir(resolved):
        return resolved
    if not os.path.isfile(resolved):
        raise refuse("", f"'input_video': no file or folder {resolved}")
    if os.path.splitext(value)[1].lower() not in VIDEO_EXTENSIONS:
        raise refuse("", f"'input_video' must be a folder of PNG/JPEG frames or a video file "
                     f"({', '.join(VIDEO_EXTENSIONS)}), got {_shown(value)}")  # fmt: skip
    return resolved


def _controls(value, chunks: int | None, has_input: bool, refuse) -> tuple[ScriptControl, ...]:
    if not isinstance(value, list):
        raise refuse("", f"'controls' must be a list of objects, got {_shown(value)}")
    if len(value) > MAX_CONTROLS:
        raise refuse("", f"'controls' holds {len(value)} controls; a script takes at most {MAX_CONTROLS}")
    out: list[ScriptControl] = []
    for index, item in enumerate(value):
        where = f"controls[{index}]"

        def bad(problem: str, where=where) -> InputError:
            return refuse(where, problem)

        if not isinstance(item, dict):
            raise bad(
                f'must be an object {{"chunk": ..., one of {", ".join(CONTROL_KINDS)}}}, got {_shown(item)}'
            )
        for key in item:
            if key not in CONTROL_KEYS:
                hint = did_you_mean(key, list(CONTROL_KEYS))
                raise bad(f"unknown key {key!r}; {hint or 'expected ' + ', '.join(CONTROL_KEYS)}")
        if "chunk" not in item:
            raise bad("'chunk' is missing: the chunk the control takes effect at (an integer >= 0)")
        chunk = item["chunk"]
        if not _is_int(chunk) or chunk < 0:
            raise bad(f"'chunk' must be an integer >= 0, got {_shown(chunk)}")
        kinds = [k for k in CONTROL_KINDS if k in item]
        if len(kinds) != 1:
            got = "none" if not kinds else " and ".join(repr(k) for k in kinds)
            raise bad(f"expected exactly one of {', '.join(map(repr, CONTROL_KINDS))}, got {got}")
        kind = kinds[0]
        if "recache" in item and kind != "prompt":
            raise bad("'recache' goes with a 'prompt' control only (a re-cache recomputes the window under a new "
                      "prompt)")  # fmt: skip
        recache = item.get("recache", False)
        if not isinstance(recache, bool):
            raise bad(f"'recache' must be true or false, got {_shown(recache)}")

        def field_refuse(_where, problem, where=where):
            return refuse(where, problem)

        if kind == "prompt":
            val = check_prompt(item["prompt"], "prompt", field_refuse)
        elif kind == "strength":
            val = check_strength_value(item["strength"], "strength", field_refuse, allow_none=True)
            if val is not None and not has_input:
                raise bad("a 'strength' control restyles the input video: give 'input_video' too (null goes back "
                          "to text to video)")  # fmt: skip
        elif kind == "seed":
            val = check_seed_value(item["seed"], "seed", field_refuse)
        else:
            if item["stop"] is not True:
                raise bad(f"'stop' must be true, got {_shown(item['stop'])}")
            if chunk < 1:
                raise bad(
                    "a stop at chunk 0 would end the session before its first chunk; 'chunk' must be >= 1"
                )
            val = True
        if chunks is not None and chunk >= chunks + (kind == "stop"):
            last = chunks if kind == "stop" else chunks - 1
            raise bad(f"'chunk' {chunk} is past the session's {chunks} chunks (0 to {last})")
        for earlier in out:
            if earlier.kind == "stop":
                if chunk >= earlier.chunk:
                    raise bad(f"chunk {chunk} comes at or after the stop at chunk {earlier.chunk} "
                              f"(controls[{earlier.index}])")  # fmt: skip
            elif kind == "stop" and earlier.chunk >= chunk:
                raise bad(f"the stop at chunk {chunk} comes at or before controls[{earlier.index}] (chunk "
                          f"{earlier.chunk})")  # fmt: skip
            if earlier.kind == kind:
                if kind == "stop":
                    raise bad(
                        f"a second stop; controls[{earlier.index}] already stops at chunk {earlier.chunk}"
                    )
                if earlier.chunk == chunk:
                    raise bad(f"chunk {chunk} already has a {kind} control (controls[{earlier.index}]); one "
                              f"control of a kind a chunk")  # fmt: skip
        out.append(ScriptControl(chunk, kind, val, recache, index))
    return tuple(out)
