"""``make test-all`` / ``make test-e2e``: the test suite as CI runs it, one summary line per run.

    python tests/e2e/run_suites.py [--e2e-only] [PYTEST_ARGS...]

Runs pytest over every test but tests/e2e (unless ``--e2e-only``), then tests/e2e once per ComfyUI checkout, each
on its own server (the ``server`` fixture in comfy_server.py starts it from ``COMFYUI_DIR``). After each run it
prints one line such as ``== tests/e2e on ComfyUI 0.8.0 (618b803d): 91 passed, 0 skipped in 437 s``, and at the
end those lines again, together, so a CI log shows every version's result in one place. It exits non-zero when
any run failed; every run happens either way, so one version's failure does not hide another's result.

Checkouts: ``COMFYUI_DIRS`` (several, separated by spaces or ``:``), else ``COMFYUI_DIR`` (one). Each runs with
its sibling ``venv/bin/python`` (the layout of ../shared/comfyui/comfy_host.sh), or ``COMFYUI_PYTHON`` when set
(then for every checkout). With neither variable, tests/e2e runs once without a server and skips every test with
its reason. ``FEWSTEP_E2E_NOT_SET_UP`` names ComfyUI versions whose setup failed (.ci/run sets it): each gets a
NOT RUN line here, so a missing version is as visible as a failing one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_version import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def checkouts_from_env(env: dict) -> list[str]:
    """The ComfyUI checkouts to run tests/e2e against: COMFYUI_DIRS, else COMFYUI_DIR, else none."""
    listed = env.get("COMFYUI_DIRS", "").strip()
    if listed:
        return [d for d in re.split(r"[\s:]+", listed) if d]
    single = env.get("COMFYUI_DIR", "").strip()
    return [single] if single else []


def counts_from_junit(path: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped of a pytest --junitxml report; None when pytest wrote none."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {
        key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def summary_line(label: str, returncode: int, counts: dict[str, int] | None, seconds: float) -> str:
    """``== LABEL: 71 passed, 0 skipped in 290 s`` (failed / errors named when there are any; FAILED when the
    run failed)."""
    if counts is None:
        result = f"no report (pytest exited with {returncode})"
    else:
        parts = [f"{counts['passed']} passed"]
        parts += [f"{counts[k]} {k}" for k in ("failed", "errors") if counts[k]]
        parts.append(f"{counts['skipped']} skipped")
        result = ", ".join(parts)
    status = "" if returncode == 0 else f" -- FAILED (pytest exit status {returncode})"
    return f"== {label}: {result} in {seconds:.0f} s{status}"


def run_pytest(label: str, args: list[str], env: dict) -> tuple[int, str]:
    """One pytest run in its own process; returns (exit status, its summary line), the line already printed."""
    with tempfile.TemporaryDirectory(prefix="fewstep-suite-") as tmp:
        report = Path(tmp) / "junit.xml"
        print(f"== {label}: pytest {' '.join(args)}", flush=True)
        start = time.monotonic()
        code = subprocess.call(
            [sys.executable, "-m", "pytest", *args, f"--junitxml={report}"], cwd=ROOT, env=env
        )
        line = summary_line(label, code, counts_from_junit(report), time.monotonic() - start)
    print(line, flush=True)
    return code, line


def main(argv: list[str]) -> int:
    e2e_only = "--e2e-only" in argv
    extra = [a for a in argv if a != "--e2e-only"]
    base_env = dict(os.environ)
    results: list[tuple[int, str]] = []
    if not e2e_only:
        results.append(
            run_pytest("tests (all but tests/e2e)", ["-q", "--ignore=tests/e2e", *extra], base_env)
        )
    checkouts = checkouts_from_env(base_env)
    for checkout in checkouts:
        env = {**base_env, "COMFYUI_DIR": checkout}
        env.pop("COMFYUI_DIRS", None)
        results.append(run_pytest(f"tests/e2e on {describe(checkout)}", ["-q", "tests/e2e", *extra], env))
    if not checkouts:
        env = {k: v for k, v in base_env.items() if k not in ("COMFYUI_DIR", "COMFYUI_DIRS")}
        label = "tests/e2e without ComfyUI (COMFYUI_DIRS and COMFYUI_DIR unset: every test skipped)"
        results.append(run_pytest(label, ["-q", "tests/e2e", *extra], env))
    not_set_up = base_env.get("FEWSTEP_E2E_NOT_SET_UP", "").split()
    lines = [line for _, line in results]
    lines += [
        f"== tests/e2e on ComfyUI {v}: NOT RUN -- its setup failed (see the log above)" for v in not_set_up
    ]
    print("\n== summary", *lines, sep="\n", flush=True)
    return 1 if any(code != 0 for code, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
