"""``FEWSTEP_*`` numeric settings: a value out of the setting's range (1e300, inf, negative, 2**80) is logged in one
line naming the variable, the value and the default used, and the default applies; the pack, the preflight and
the CLI keep working under such values."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fewstep
from fewstep.engine import settings
from fewstep.engine.preflight import budget as preflight

IMPORT_PATH = str(Path(fewstep.__file__).parent.parent)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())


@pytest.mark.parametrize("value", ["1e300", "inf", "-inf", "nan", "-1", "0", "65537", str(2**80)])
def test_an_out_of_range_number_is_said_once_and_the_default_used(monkeypatch, caplog, value):
    monkeypatch.setenv("FEWSTEP_TEST_GB", value)
    with caplog.at_level(logging.WARNING, logger=settings.__name__):
        got = [settings.env_float("FEWSTEP_TEST_GB", 16.0, minimum=0.0, maximum=65536.0) for _ in range(3)]
    assert got == [16.0] * 3
    assert caplog.messages == [
        f"fewstep: ignoring FEWSTEP_TEST_GB={value!r} (expected a number > 0 and <= 65536); using 16.0"
    ]


@pytest.mark.parametrize("value", [str(2**80), "-1", "0", "1025", "1e3", "9" * 5000])
def test_an_out_of_range_integer_is_said_once_and_the_default_used(monkeypatch, caplog, value):
    monkeypatch.setenv("FEWSTEP_TEST_COUNT", value)
    with caplog.at_level(logging.WARNING, logger=settings.__name__):
        got = [settings.env_int("FEWSTEP_TEST_COUNT", 4, minimum=1, maximum=1024) for _ in range(2)]
    assert got == [4, 4]
    assert caplog.messages == [
        f"fewstep: ignoring FEWSTEP_TEST_COUNT={value!r} (expected an integer from 1 to 1024); using 4"
    ]


def test_values_at_the_ends_of_the_range_are_taken(monkeypatch):
    monkeypatch.setenv("FEWSTEP_TEST_COUNT", "1024")
    monkeypatch.setenv("FEWSTEP_TEST_GB", "65536")
    assert settings.env_int("FEWSTEP_TEST_COUNT", 4, minimum=1, maximum=1024) == 1024
    assert settings.env_float("FEWSTEP_TEST_GB", 16.0, minimum=0.0, maximum=65536.0) == 65536.0


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("FEWSTEP_")}
    environment.update(env, PYTHONPATH=IMPORT_PATH)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)


def test_the_pack_imports_with_all_its_nodes_under_a_huge_session_budget():
    huge = {
        "FEWSTEP_SESSION_GB": "1e300",
        "FEWSTEP_MAX_SESSIONS": str(2**80),
        "FEWSTEP_MAX_PROMPTS": "-3",
        "FEWSTEP_STREAM_CHUNKS_KEPT": "1e300",
        "FEWSTEP_MEMORY_LIMIT_GB": "inf",
    }
    code = (
        "import fewstep, fewstep.nodes.video as v, fewstep.nodes.chunk_stream as c; "
        "print(len(fewstep.NODE_CLASS_MAPPINGS), v.SESSIONS.max_sessions, v.SESSIONS.explicit_max_bytes, "
        "v.MAX_PROMPTS, c.CHUNKS_KEPT)"
    )
    r = _python(code, **huge)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(fewstep.NODE_CLASS_MAPPINGS)), "4", "None", "8", "64"]
    for name in (
        "FEWSTEP_SESSION_GB",
        "FEWSTEP_MAX_SESSIONS",
        "FEWSTEP_MAX_PROMPTS",
        "FEWSTEP_STREAM_CHUNKS_KEPT",
    ):
        assert f"fewstep: ignoring {name}={huge[name]!r}" in r.stderr


@pytest.mark.parametrize("value", ["1e300", "inf", "-5"])
def test_the_preflight_works_under_an_out_of_range_memory_limit(monkeypatch, caplog, value):
    monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB", raising=False)
    unlimited = preflight.total_bytes("cpu")
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", value)
    assert preflight.total_bytes("cpu") == unlimited
    assert preflight.available_bytes("cpu") > 0
    assert preflight.check_fits({"weights": 1 << 20}, "cpu", "model") == 1 << 20
    assert f"ignoring FEWSTEP_MEMORY_LIMIT_GB={value!r}" in caplog.text


def test_the_queue_command_starts_under_a_huge_file_limit(tmp_path):
    missing = tmp_path / "missing.json"
    code = f"import sys; from fewstep.cli import main; sys.exit(main(['queue', {str(missing)!r}]))"
    r = _python(code, FEWSTEP_QUEUE_MAX_FILE_GB="1e300")
    assert r.returncode == 5, r.stderr
    assert "fewstep: ignoring FEWSTEP_QUEUE_MAX_FILE_GB='1e300'" in r.stderr
    assert f"error: cannot read {missing}" in r.stderr
    r = _python(
        "from fewstep.cli import comfy_client as c; print(c.MAX_FILE_BYTES)",
        FEWSTEP_QUEUE_MAX_FILE_GB="1e300",
    )
    assert r.stdout.split() == [str(16 << 30)]
