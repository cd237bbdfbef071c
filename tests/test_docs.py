"""The documentation's own rules: a README a newcomer reads in one sitting, links that resolve, and
file formats documented inside the repository (docs/formats.md), never by pointing outside it."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = ("SCHEMAS.md", "ARCHITECTURE.md", "STYLE.md", "shared/design")


def test_the_readme_stays_under_200_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 200


def test_every_link_of_the_readme_and_docs_resolves():
    r = subprocess.run([sys.executable, "scripts/check_links.py"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_nothing_in_the_repository_points_outside_it_for_its_formats():
    found = []
    for top in ("hetero", "backends", "predictor", "planner", "configs", "docs", "benchmarks", "scripts", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith((".py", ".md", ".yaml", ".yml", ".cpp", ".sh")) or name == "test_docs.py":
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                found += [f"{os.path.relpath(path, ROOT)}: {o}" for o in OUTSIDE if o in text]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        found += [f"README.md: {o}" for o in OUTSIDE if o in f.read()]
    assert not found, found
