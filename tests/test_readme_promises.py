"""Every test the README names as holding a promise exists (a renamed or deleted test would
leave the promise unbacked while the README still points at it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_readme_names_exists():
    named = []
    for line in (ROOT / "README.md").read_text().splitlines():
        current = None
        for file, test in re.findall(r"`(test_\w+\.py)?::(test_\w+)`", line):
            current = file or current
            assert current, f"README names ::{test} without its file: {line[:80]}"
            named.append((current, test))
    assert len(named) >= 20
    missing = [
        f"{file}::{test}"
        for file, test in named
        if not re.search(rf"^def {test}\(", (ROOT / "tests" / file).read_text(), re.M)
    ]
    assert not missing, missing
