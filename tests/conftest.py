"""Shared test fixtures: paths to the repository, its configs and the public data in ../shared."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetero.shared_data import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session", autouse=True)
def own_profile_cache(tmp_path_factory) -> Path:
    """Every test, and every process a test starts, uses a profile cache of the suite's own
    (``HETERO_CACHE_DIR``, empty at the start), never the user's ``~/.cache/hetero``: a profile
    measured on a loaded machine must not change what the tests see. A test that needs a profile
    writes one (or points ``HETERO_CACHE_DIR`` elsewhere with monkeypatch)."""
    import os

    path = tmp_path_factory.mktemp("hetero-cache")
    previous = os.environ.get("HETERO_CACHE_DIR")
    os.environ["HETERO_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("HETERO_CACHE_DIR", None)
    else:
        os.environ["HETERO_CACHE_DIR"] = previous


@pytest.fixture
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"public measurement data not found at {path} (set HETERO_SHARED_DATA)")
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m hetero ARGS`` in a subprocess; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "hetero", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)
