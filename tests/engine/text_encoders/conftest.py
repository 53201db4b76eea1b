"""Tiny encoder folders, written once per test session (tests/tiny_text_encoders.py)."""

from __future__ import annotations

import pytest
import tiny_text_encoders as tiny

pytest.importorskip("transformers", reason="transformers not installed (the text extra)")


@pytest.fixture(scope="session")
def encoder_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_encoders")
    p = {name: params for name, (_, params) in tiny.presets().items()}
    return {
        "flux": tiny.write_flux1_folder(str(root / "flux1"), p["flux-tiny"]),
        "wan": tiny.write_wan_folder(str(root / "wan"), p["wan-tiny"]),
        "klein": tiny.write_klein_folder(str(root / "klein"), p["flux2-tiny"]),
        "zimage": tiny.write_zimage_folder(str(root / "zimage"), p["zimage-tiny"]),
    }
