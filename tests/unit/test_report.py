"""BENCHMARKS.md is what `python benchmarks/report.py` makes of benchmarks/results/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_regenerated_from_the_results() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr


def test_every_placeholder_names_a_renderer_and_a_result() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.pop(0)
    for line in report.TEMPLATE.read_text().splitlines():
        m = report.PLACEHOLDER.match(line.strip())
        if m:
            assert m.group(1) in report.RENDERERS, line
            for name in m.group(2).split():
                if m.group(1) not in ("paper", "auto_vs_best"):  # long sweeps' optional parts
                    assert (report.RESULTS / name).exists(), f"{line}: {name} is missing"
