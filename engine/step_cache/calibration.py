"""MagCache calibration: per-step residual-magnitude ratios recorded for one model and one step count.

A calibration run computes every step and records ``ratio_t = mean over tokens of |r_t| / |r_t-1|`` where
``r_t`` is the residual the whole block stack adds at step ``t`` (``ratio_0 = 1``). The file (JSON) names the
model it was recorded on (family, preset, a hash of the configuration) and the step count; loading it for
another model or another step count is refused, since the ratios are a property of both.

File layout::

    {"format": "fewstep-magcache", "version": 1,
     "model": {"family": "flux", "preset": "flux.1-dev", "config": "<sha1 of the configuration>"},
     "steps": 28, "sampler": "euler", "sigmas": [...], "ratios": [1.0, ...], "ratio_std": [0.0, ...]}
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..loader import preset_of
from ..names import name_problem

FORMAT = "fewstep-magcache"
VERSION = 1
SUFFIX = ".json"
DIR_VARIABLE = "FEWSTEP_MAGCACHE_DIR"
MAX_NAME_LENGTH = 200

# MagCache's published ratios for FLUX.1-dev at 28 steps (Zehong-Ma/MagCache, MagCache4FLUX/magcache_flux.py,
# ``mag_ratios``; the same whole-stack image-token residual as here). Used when no file is given.
PUBLISHED_RATIOS: dict[tuple[str, int], tuple[float, ...]] = {
    ("flux.1-dev", 28): (
        1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047,
        1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484,
        0.95703, 0.93359, 0.89062,
    ),
}  # fmt: skip


def config_hash(config) -> str:
    text = json.dumps(config, sort_keys=True, default=str) if isinstance(config, dict) else repr(config)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def model_identity(model) -> dict:
    """What a calibration is tied to: the family, the preset name (or "custom") and the configuration."""
    return {
        "family": type(model).family,
        "preset": preset_of(model) or "custom",
        "config": config_hash(model.params),
    }


def describe_identity(identity: dict) -> str:
    return f"{identity.get('family')} [{identity.get('preset')}, config {identity.get('config')}]"


@dataclass(frozen=True)
class MagCacheCalibration:
    model: dict
    steps: int
    ratios: tuple[float, ...]
    sampler: str = ""
    sigmas: tuple[float, ...] = ()
    ratio_std: tuple[float, ...] = ()
    source: str = ""

    def check(
        self, identity: dict, steps: int | None = None, model_input: str = "model", steps_input="steps"
    ):
        if (identity.get("family"), identity.get("config")) != (
            self.model.get("family"),
            self.model.get("config"),
        ):
            raise InputError(
                model_input,
                f"the MagCache calibration {self.source or ''} was recorded on {describe_identity(self.model)}; "
                f"this model is {describe_identity(identity)}: calibrate for this model (calibrate on)",
            )
        if steps is not None and steps != self.steps:
            raise InputError(
                steps_input,
                f"the MagCache calibration {self.source or ''} was recorded for {self.steps} steps; this run "
                f"has {steps}: use {self.steps} steps or calibrate for {steps} (the ratios are per step)",
            )

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "steps": self.steps, "sampler": self.sampler,
            "sigmas": list(self.sigmas), "ratios": list(self.ratios), "ratio_std": list(self.ratio_std),
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def load_calibration(path: str | Path, input_name: str = "magcache_file") -> MagCacheCalibration:
    path = Path(path)
    if not path.is_file():
        raise InputError(input_name, f"MagCache calibration file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(input_name, f"{path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(input_name, f'{path} is not a MagCache calibration (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise InputError(input_name, f"{path}: calibration version {data.get('version')}, expected {VERSION}")
    ratios = data.get("ratios")
    steps = data.get("steps")
    model = data.get("model")
    if (
        not isinstance(model, dict)
        or not isinstance(steps, int)
        or not isinstance(ratios, list)
        or len(ratios) != steps
        or not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in ratios)
    ):
        raise InputError(
            input_name, f"{path}: expected a model, a step count and that many positive finite ratios"
        )
    return MagCacheCalibration(
        model=model, steps=steps, ratios=tuple(float(r) for r in ratios), sampler=str(data.get("sampler", "")),
        sigmas=tuple(data.get("sigmas", ())), ratio_std=tuple(data.get("ratio_std", ())), source=str(path),
    )  # fmt: skip


def default_calibration_dir() -> Path:
    """Where calibrations live outside ComfyUI: ``$FEWSTEP_MAGCACHE_DIR``, else ``$XDG_DATA_HOME/fewstep/magcache``
    (``~/.local/share/fewstep/magcache``). Inside ComfyUI the nodes use ``models/fewstep_magcache`` instead."""
    explicit = os.environ.get(DIR_VARIABLE, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(data_home) / "fewstep" / "magcache"


def _name_problem(name) -> str | None:
    if not isinstance(name, str) or not name:
        return "it is empty"
    unreadable = name_problem(name)  # control, bidi, zero-width, surrogate...: the pack's one name check
    if unreadable is not None:
        return unreadable
    if "/" in name or "\\" in name:
        return "it contains a '/' or '\\' (a path)"
    if name.startswith("."):
        return "it starts with '.'"
    if name != name.strip():
        return "it starts or ends with a space"
    if len(name) > MAX_NAME_LENGTH:
        return f"it is longer than {MAX_NAME_LENGTH} characters"
    return None


def calibration_file_name(name: str, input_name: str = "calibration_name") -> str:
    """``name`` as a file in the calibration folder: a plain name (no path, no '..', no control characters),
    with ``.json`` added when it has another ending."""
    problem = _name_problem(name)
    if problem is not None:
        raise InputError(
            input_name,
            f"{name!r} is not a plain file name ({problem}): give a name such as 'flux-dev-28.json'; "
            "calibrations are written to the pack's calibration folder",
        )
    return name if name.lower().endswith(SUFFIX) else name + SUFFIX


def list_calibration_files(folder: str | Path) -> list[str]:
    """The calibration (``.json``) files directly in ``folder``, sorted; none when it does not exist. A file whose
    name a calibration run would refuse (a bidi override, a zero-width character: see ``names``) is not offered:
    the list is shown to everyone who opens the node."""
    try:
        return sorted(
            p.name
            for p in Path(folder).iterdir()
            if p.suffix.lower() == SUFFIX and _name_problem(p.name) is None and p.is_file()
        )
    except OSError:
        return []


def published_calibration(model, steps: int) -> MagCacheCalibration | None:
    ratios = PUBLISHED_RATIOS.get((preset_of(model), steps))
    if ratios is None:
        return None
    return MagCacheCalibration(
        model_identity(model), steps, ratios, source="(published, Zehong-Ma/MagCache MagCache4FLUX)"
    )


__all__ = [
    "MagCacheCalibration",
    "PUBLISHED_RATIOS",
    "calibration_file_name",
    "config_hash",
    "default_calibration_dir",
    "describe_identity",
    "list_calibration_files",
    "load_calibration",
    "model_identity",
    "published_calibration",
]
