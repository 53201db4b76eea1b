"""run_suites.py (``make test-all`` / ``make test-e2e``): which runs it makes, the summary line of each, and its
exit status. The pytest runs themselves are replaced by a recorder; no server needed."""

from __future__ import annotations

import run_suites


def test_checkouts_come_from_comfyui_dirs_else_comfyui_dir():
    assert run_suites.checkouts_from_env({"COMFYUI_DIRS": "/a/ComfyUI /b/ComfyUI", "COMFYUI_DIR": "/c"}) == [
        "/a/ComfyUI",
        "/b/ComfyUI",
    ]
    assert run_suites.checkouts_from_env({"COMFYUI_DIRS": "/a:/b"}) == ["/a", "/b"]
    assert run_suites.checkouts_from_env({"COMFYUI_DIRS": " ", "COMFYUI_DIR": "/c"}) == ["/c"]
    assert run_suites.checkouts_from_env({}) == []


def test_summary_line():
    counts = {"passed": 71, "failed": 0, "errors": 0, "skipped": 0}
    assert (
        run_suites.summary_line("tests/e2e on ComfyUI 0.8.0 (618b803d)", 0, counts, 290.4)
        == "== tests/e2e on ComfyUI 0.8.0 (618b803d): 71 passed, 0 skipped in 290 s"
    )
    counts = {"passed": 69, "failed": 2, "errors": 1, "skipped": 3}
    assert (
        run_suites.summary_line("x", 1, counts, 10)
        == "== x: 69 passed, 2 failed, 1 errors, 3 skipped in 10 s -- FAILED (pytest exit status 1)"
    )
    assert (
        run_suites.summary_line("x", 4, None, 1)
        == "== x: no report (pytest exited with 4) in 1 s -- FAILED (pytest exit status 4)"
    )


def test_counts_from_a_junit_report(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
        'skipped="3" tests="12" time="1.0"></testsuite></testsuites>'
    )
    assert run_suites.counts_from_junit(report) == {"passed": 6, "failed": 2, "errors": 1, "skipped": 3}
    assert run_suites.counts_from_junit(tmp_path / "missing.xml") is None


def _fake_runs(monkeypatch, codes: dict[str, int]) -> list:
    calls = []

    def run(label, args, env):
        calls.append((label, args, env.get("COMFYUI_DIR"), "COMFYUI_DIRS" in env))
        code = next((c for key, c in codes.items() if key in label), 0)
        return code, f"== {label}: {'FAILED' if code else 'ok'}"

    monkeypatch.setattr(run_suites, "run_pytest", run)
    monkeypatch.setattr(run_suites, "describe", lambda checkout: f"ComfyUI at {checkout}")
    return calls


def test_each_checkout_gets_its_own_run_and_line_and_any_failure_fails(monkeypatch, capsys):
    monkeypatch.setenv("COMFYUI_DIRS", "/old/ComfyUI /new/ComfyUI")
    monkeypatch.delenv("COMFYUI_DIR", raising=False)  # set when this very test runs under run_suites.py
    monkeypatch.setenv("FEWSTEP_E2E_NOT_SET_UP", "0.9.0")
    calls = _fake_runs(monkeypatch, {"/new/": 1})
    assert run_suites.main([]) == 1
    assert [(c[0], c[2], c[3]) for c in calls] == [
        ("tests (all but tests/e2e)", None, True),
        ("tests/e2e on ComfyUI at /old/ComfyUI", "/old/ComfyUI", False),
        ("tests/e2e on ComfyUI at /new/ComfyUI", "/new/ComfyUI", False),
    ]
    assert calls[0][1][:2] == ["-q", "--ignore=tests/e2e"] and calls[1][1][:2] == ["-q", "tests/e2e"]
    summary = capsys.readouterr().out.split("== summary\n", 1)[1].splitlines()
    assert summary == [
        "== tests (all but tests/e2e): ok",
        "== tests/e2e on ComfyUI at /old/ComfyUI: ok",
        "== tests/e2e on ComfyUI at /new/ComfyUI: FAILED",
        "== tests/e2e on ComfyUI 0.9.0: NOT RUN -- its setup failed (see the log above)",
    ]


def test_e2e_only_without_comfyui_runs_once_and_passes(monkeypatch):
    monkeypatch.delenv("COMFYUI_DIRS", raising=False)
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    monkeypatch.delenv("FEWSTEP_E2E_NOT_SET_UP", raising=False)
    calls = _fake_runs(monkeypatch, {})
    assert run_suites.main(["--e2e-only", "-x"]) == 0
    assert len(calls) == 1 and calls[0][0].startswith("tests/e2e without ComfyUI") and calls[0][2] is None
    assert calls[0][1] == ["-q", "tests/e2e", "-x"]


def test_the_main_run_failing_fails_the_whole(monkeypatch):
    monkeypatch.setenv("COMFYUI_DIR", "/one/ComfyUI")
    monkeypatch.delenv("COMFYUI_DIRS", raising=False)
    calls = _fake_runs(monkeypatch, {"all but": 2})
    assert run_suites.main([]) == 1
    assert [c[0] for c in calls] == ["tests (all but tests/e2e)", "tests/e2e on ComfyUI at /one/ComfyUI"]
