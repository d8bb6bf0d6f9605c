"""A cache of native libraries that loads only what this user built (docs/reliability.md,
"The kernel cache").

:mod:`dynamiq.kernels.cpu_native` compiles its C++ kernels once per machine and keeps the
shared object in a cache directory, under a name anyone can compute. Loading a library runs
its constructors, so a file put there by someone else, or a damaged one, must never reach
``dlopen``. This module holds to four rules:

* **Safe location.** A library is loaded only from a directory that is owned by this user or
  root and writable by no one else, whose every ancestor is owned by this user or root and
  writable by no one else, or sticky (``/tmp``: others may add entries but not replace
  ours). An unsafe cache directory (a world-writable, non-sticky one; one owned by another
  user) is not used: :func:`cache_dir` warns (:class:`UnsafeCacheWarning`) and falls back to
  a private 0700 directory under the system's temporary directory (or, if that name is taken
  by someone else, a fresh one for this process).
* **Safe file.** The library and its digest are regular files (not symlinks) owned by this
  user or root and writable by no one else, checked on the open descriptor.
* **Integrity.** The build records the SHA-256 of the library's bytes in ``<name>.sha256``;
  a load reads the library through one descriptor, hashes its bytes and compares before
  ``dlopen`` (on Linux ``dlopen`` opens that very descriptor, ``/proc/self/fd/N``, so what
  was hashed is what runs). A truncated or damaged file (which ``dlopen`` would map and die
  on with SIGBUS) is rebuilt, with a warning.
* **Atomic writes.** The library and the digest are written to temporary files in the cache
  directory and renamed into place, and builders take an exclusive lock (``flock`` on
  ``<name>.lock``), so concurrent processes build once and never see a partial file: a
  reader that finds no valid pair takes the lock, looks again, and builds only if still
  needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: the atomic renames still hold
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "UnsafeCacheWarning",
    "cache_dir",
    "digest_path",
    "load",
    "unsafe_reason",
    "write_digest",
]

#: what another user may not do to a directory or file of the cache
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_WARNED: set[tuple[str, str]] = set()


class UnsafeCacheWarning(RuntimeWarning):
    """The kernel cache directory, or a file in it, is not safe to load from (see
    :mod:`dynamiq.kernels._libcache`)."""


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _owner_name(st: os.stat_result) -> str:
    return f"uid {st.st_uid}"


def unsafe_reason(directory: Path) -> str | None:
    """Why ``directory`` (which exists) is not a safe place to load libraries from, or
    ``None`` if it is: it and every ancestor of its real path must be owned by this user or
    root and writable by no one else, except that an ancestor may be sticky."""
    real = Path(os.path.realpath(directory))
    chain = [real, *real.parents]
    for i, p in enumerate(chain):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):  # realpath resolved them: one appeared since
            return f"{p} is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a directory"
        if not _owner_ok(st):
            return f"{p} is owned by {_owner_name(st)}, not by this user or root"
        sticky_ok = i > 0 and bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & _OTHERS_WRITE and not sticky_ok:
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            kind = "the cache directory" if i == 0 else "an ancestor, not sticky,"
            return f"{p} ({kind}) is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make_dirs(directory: Path) -> None:
    """Create the missing directories of ``directory``, each 0700 (less the umask)."""
    missing = []
    p = Path(os.path.abspath(directory))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it
            os.mkdir(d, 0o700)


def _warn_once(requested: Path, reason: str, fallback: Path) -> None:
    key = (str(requested), reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"dynamiq: the kernel cache {requested} is not safe to load libraries from "
        f"({reason}); using the private directory {fallback} instead",
        UnsafeCacheWarning,
        stacklevel=4,
    )


def _private_dir() -> Path:
    """A 0700 directory of this user under the temporary directory (a fresh one if the
    per-user name is taken or unsafe)."""
    uid = os.geteuid()
    base = Path(tempfile.gettempdir()) / f"dynamiq-cpu-kernels-{uid}"
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return Path(tempfile.mkdtemp(prefix="dynamiq-cpu-kernels-"))
    if unsafe_reason(base) is None:
        return base
    return Path(tempfile.mkdtemp(prefix="dynamiq-cpu-kernels-"))


def cache_dir(requested: Path) -> Path:
    """``requested`` (created if missing) if it is a safe place to load libraries from, else
    a private directory, with one :class:`UnsafeCacheWarning` per location and reason."""
    try:
        _make_dirs(requested)
        reason = unsafe_reason(requested)
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if reason is None:
        return requested
    fallback = _private_dir()
    _warn_once(requested, reason, fallback)
    return fallback


def digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _read_checked(path: Path) -> tuple[int, bytes]:
    """``(fd, bytes)`` of a regular file owned by this user or root and writable by no one
    else (the checks are made on the open descriptor); raises ``OSError`` or ``ValueError``
    saying why not. The caller closes ``fd``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if not _owner_ok(st):
            raise ValueError(f"{path} is owned by {_owner_name(st)}, not by this user or root")
        if st.st_mode & _OTHERS_WRITE:
            raise ValueError(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return fd, b"".join(chunks)
    except BaseException:
        os.close(fd)
        raise


def _try_load(lib: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` if ``lib`` and its digest pass every check, else ``(None, why)``
    (``why`` is ``None`` when there is simply no library yet)."""
    if not os.path.lexists(lib):
        return None, None
    try:
        fd_d, recorded = _read_checked(digest_path(lib))
        os.close(fd_d)
    except FileNotFoundError:
        return None, f"{lib} has no recorded digest"
    except (OSError, ValueError) as exc:
        return None, str(exc)
    try:
        fd, data = _read_checked(lib)
    except (OSError, ValueError) as exc:
        return None, str(exc)
    try:
        if hashlib.sha256(data).hexdigest() != recorded.decode("ascii", "replace").strip():
            return None, f"{lib} does not match its recorded SHA-256 ({len(data)} bytes)"
        by_fd = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(lib)), None
    finally:
        os.close(fd)


def write_digest(lib_tmp: Path, dest: Path) -> Path:
    """Record the SHA-256 of the freshly built ``lib_tmp`` (to be renamed to ``dest``) in a
    temporary file beside it; returns that file (the caller renames it after the library)."""
    digest = hashlib.sha256(lib_tmp.read_bytes()).hexdigest()
    fd, tmp = tempfile.mkstemp(suffix=".sha256.tmp", dir=dest.parent)
    with os.fdopen(fd, "w") as f:
        f.write(digest + "\n")
    os.chmod(tmp, 0o644)
    return Path(tmp)


@contextlib.contextmanager
def _locked(lib: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(lib.with_name(lib.name + ".lock"), flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def load(lib: Path, build: Callable[[Path], None]) -> ctypes.CDLL:
    """The verified library at ``lib`` (in a directory :func:`cache_dir` returned), built by
    ``build(lib)`` first where it is missing, damaged or not trusted; ``build`` writes the
    library and its digest atomically (see ``cpu_native._build``)."""
    found, _ = _try_load(lib)  # the common case: no lock
    if found is not None:
        return found
    with _locked(lib):
        found, why = _try_load(lib)  # another process may have built it meanwhile
        if found is not None:
            return found
        if why is not None and "no recorded digest" not in why:
            warnings.warn(
                f"dynamiq: rebuilding the native CPU kernels: {why}",
                UnsafeCacheWarning,
                stacklevel=3,
            )
        build(lib)
        found, why = _try_load(lib)
    if found is None:
        raise RuntimeError(f"the library just built failed its checks: {why}")
    return found
