"""Where the public measurement data lives: ``$HETERO_SHARED_DATA``, else ``../shared/data``
beside the repository (see that folder's README). Tests and benchmarks skip with a message when
it is absent; nothing in the package needs it at run time."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir(repo_root: str | os.PathLike | None = None) -> Path:
    """``$HETERO_SHARED_DATA`` if set, else ``<repo_root>/../shared/data`` (default: this checkout)."""
    env = os.environ.get("HETERO_SHARED_DATA")
    if env:
        return Path(env)
    return Path(repo_root or REPO_ROOT).parent / "shared" / "data"
