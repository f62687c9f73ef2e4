"""Where twin finds the project's shared read-only material (``../shared`` beside the repository)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """``$TWIN_SHARED`` if set, else ``../shared`` next to the repository root."""
    env = os.environ.get("TWIN_SHARED")
    return Path(env) if env else REPO_ROOT.parent / "shared"
