"""The pack's one check of names others give it (engine/names.py): what it refuses, how the refusal reads."""

from __future__ import annotations

import pytest

from fewstep.engine.errors import InputError
from fewstep.engine.names import check_name, name_problem


@pytest.mark.parametrize(
    "ch, described",
    [
        ("\x00", "U+0000, a control character"),
        ("\x1b", "U+001B, a control character"),
        ("\x85", "U+0085, a control character"),
        ("\u202a", "U+202A LEFT-TO-RIGHT EMBEDDING, an invisible format character"),
        ("\u202e", "U+202E RIGHT-TO-LEFT OVERRIDE, an invisible format character"),
        ("\u2066", "U+2066 LEFT-TO-RIGHT ISOLATE, an invisible format character"),
        ("\u2069", "U+2069 POP DIRECTIONAL ISOLATE, an invisible format character"),
        ("\u200b", "U+200B ZERO WIDTH SPACE, an invisible format character"),
        ("\u200f", "U+200F RIGHT-TO-LEFT MARK, an invisible format character"),
        ("\ufeff", "U+FEFF ZERO WIDTH NO-BREAK SPACE, an invisible format character"),
        ("\u00ad", "U+00AD SOFT HYPHEN, an invisible format character"),
        ("\ud800", "U+D800, a lone surrogate, which no file name can hold"),
        ("\udc80", "U+DC80, a lone surrogate, which no file name can hold"),
        ("\ue000", "U+E000, a private-use character"),
        ("\U000e0001", "U+E0001 LANGUAGE TAG, an invisible format character"),
        ("\u0378", "U+0378, an unassigned code point"),
        ("\u2028", "U+2028 LINE SEPARATOR, a line separator"),
        ("\u2029", "U+2029 PARAGRAPH SEPARATOR, a paragraph separator"),
    ],
)
def test_each_refused_kind_is_named_by_its_code_point(ch, described):
    name = f"clip{ch}.webp"
    assert name_problem(name).startswith(f"it contains {described}")
    with pytest.raises(InputError) as err:
        check_name(name, "calibration_name", "FewStepCacheGate")
    assert str(err.value) == (
        f"FewStepCacheGate: input 'calibration_name': {name!r} cannot name a file: {name_problem(name)}"
    )
    assert ch not in str(err.value)  # printed escaped


@pytest.mark.parametrize(
    "name", ["flux-dev-28.json", "café 1.json", "日本語.webp", "clip 🎞.webp", "a b-c_d.e"]
)
def test_names_that_read_as_what_they_are_pass(name):
    assert name_problem(name) is None and check_name(name, "x") == name


def test_a_name_that_is_not_text_is_refused():
    with pytest.raises(InputError, match=r"^input 'magcache_file': 12 is not text: expected a file name$"):
        check_name(12, "magcache_file")
