"""Running Triton kernels on CPU under Triton's interpreter, for the kernel test modules.

A module marks its interpreter tests ``interpreted_only`` (skipped in the normal run) and calls
:func:`run_interpreted_tests` from one ordinary test, which re-runs the module in a child pytest
with ``TRITON_INTERPRET=1`` and ``NANOVLLM_TRITON_INTERPRET=1`` set before Triton is imported.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the child pytest under Triton's interpreter")
eager_only = pytest.mark.skipif(INTERPRETED, reason="checks the CPU reference dispatch")


def require_triton() -> None:
    """Triton is a dependency on Linux (pyproject.toml): import it there, so a broken install fails
    the test; skip elsewhere, where it is not installed."""
    if sys.platform == "linux":
        import triton  # noqa: F401
    else:
        pytest.importorskip("triton")


def run_interpreted_tests(test_file: str, min_passed: int) -> None:
    """Run ``test_file``'s ``interpreted`` tests in a child pytest; assert they all pass."""
    require_triton()
    root = Path(test_file).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", NANOVLLM_TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-k", "interpreted", "-p", "no:cacheprovider",
         "-W", "ignore::RuntimeWarning"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    report = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= min_passed, report
    assert "skipped" not in result.stdout, report
