"""The native kernel cache loads only what this user built (dynamiq/kernels/_libcache.py):
safe locations, safe files, a digest checked before dlopen, atomic writes and one build
among concurrent processes.

No test compiles the kernels: a stand-in "compiler" (``CXX``) copies the library this
process already loaded to its ``-o`` path (slowly, where a test wants a wide race window),
so the build code path runs as it would with g++.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from dynamiq.kernels import _libcache, cpu_native

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture(scope="module")
def good_library() -> Path:
    """The library this process loads (built once per machine in the real cache)."""
    if not cpu_native.available():
        pytest.skip("the native CPU kernels cannot be built here")
    return cpu_native.library_path()


def _fake_cxx(tmp: Path, source: Path, *, slow: bool = False) -> Path:
    """A "compiler" copying ``source`` to its ``-o`` argument (``slow``: half, a pause, the
    rest) and logging each call to ``calls.log`` beside it."""
    script = tmp / "fake-cxx"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        out = sys.argv[sys.argv.index("-o") + 1]
        with open({str(tmp / "calls.log")!r}, "a") as log:
            log.write(out + "\\n")
        data = open({str(source)!r}, "rb").read()
        with open(out, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep({1.0 if slow else 0.0})
            f.write(data[len(data) // 2 :])
        """)
    )
    script.chmod(0o755)
    return script


def _calls(tmp: Path) -> int:
    log = tmp / "calls.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, good_library: Path) -> Path:
    """No loaded library (restored afterwards), the stand-in compiler, and a private temporary
    directory for the fallback; returns the scratch directory."""
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_FAILURE", None)
    monkeypatch.setattr(_libcache, "_WARNED", set())
    monkeypatch.setenv("CXX", str(_fake_cxx(tmp_path, good_library)))
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    return tmp_path


def _encodes() -> bytes:
    """An int8 encoding by the native kernel (what a loaded library must compute)."""
    from dynamiq import get_codec
    from dynamiq.kernels import encode

    x = torch.linspace(-3, 5, cpu_native.MIN_NUMEL)
    return bytes(encode(get_codec("int8"), x, backend="cpu").numpy())


def _evil_library(tmp: Path, marker: Path) -> bytes:
    """A library with the kernels' ABI symbol whose constructor writes ``marker``."""
    src = tmp / "evil.c"
    src.write_text(
        textwrap.dedent(f"""\
        #include <stdio.h>
        __attribute__((constructor)) static void mark(void) {{
            FILE *f = fopen("{marker}", "w");
            if (f) {{ fputs("constructor ran", f); fclose(f); }}
        }}
        int dq_abi_version(void) {{ return 3; }}
        """)
    )
    out = tmp / "evil.so"
    cc = shutil.which("cc") or shutil.which("gcc") or "g++"  # not $CXX: the stand-in
    subprocess.run([cc, "-x", "c", "-shared", "-fPIC", "-o", out, src], check=True)
    data = out.read_bytes()
    # the plant works: loaded directly, the constructor runs (in a child: not in this process)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(out)!r})"], check=True)
    assert marker.exists()
    marker.unlink()
    return data


def _plant(directory: Path, data: bytes, *, digest: bool = True) -> Path:
    """``data`` under the library's expected name in ``directory`` (with a matching digest)."""
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / cpu_native.library_path().name
    lib.write_bytes(data)
    lib.chmod(0o755)
    if digest:
        _libcache.digest_path(lib).write_text(hashlib.sha256(data).hexdigest() + "\n")
    return lib


# -- untrusted files and places are never loaded --------------------------------------------


@pytest.mark.parametrize("place", ["world_writable", "other_owner", "ancestor_world_writable"])
def test_unsafe_cache_directory_is_not_loaded_from(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, place: str
) -> None:
    marker = fresh / "constructor.marker"
    evil = _evil_library(fresh, marker)
    root = fresh / "cache"
    root.mkdir()
    base = root / "sub" if place == "ancestor_world_writable" else root
    monkeypatch.setenv("DYNAMIQ_CACHE", str(base))
    lib = _plant(base / "cpu-kernels", evil)
    if place == "world_writable":
        (base / "cpu-kernels").chmod(0o777)
    elif place == "other_owner":
        os.chown(base / "cpu-kernels", NOBODY, NOBODY)
    else:
        root.chmod(0o777)  # not sticky: anyone may replace "sub"
    with pytest.warns(_libcache.UnsafeCacheWarning, match="not safe to load") as record:
        assert cpu_native.available()
    assert not marker.exists(), "the planted library's constructor ran"
    private = fresh / "tmp" / f"dynamiq-cpu-kernels-{os.geteuid()}"
    assert str(private) in str(record[0].message)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert cpu_native.library_path().parent == private
    assert _encodes() and lib.read_bytes() == evil  # the planted file was left alone
    assert _calls(fresh) == 1  # built once, in the private directory


@pytest.mark.parametrize("fault", ["other_owner", "no_digest", "wrong_digest", "writable"])
def test_untrusted_library_file_is_rebuilt_not_loaded(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, fault: str
) -> None:
    marker = fresh / "constructor.marker"
    evil = _evil_library(fresh, marker)
    monkeypatch.setenv("DYNAMIQ_CACHE", str(fresh / "cache"))
    lib = _plant(fresh / "cache" / "cpu-kernels", evil, digest=fault != "no_digest")
    if fault == "other_owner":
        os.chown(lib, NOBODY, NOBODY)
    elif fault == "wrong_digest":
        _libcache.digest_path(lib).write_text("0" * 64 + "\n")
    elif fault == "writable":
        lib.chmod(0o777)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cpu_native.available()
    assert not marker.exists(), "the planted library's constructor ran"
    assert _calls(fresh) == 1
    assert _encodes()
    messages = [str(w.message) for w in record]
    if fault == "no_digest":  # a library from before digests: rebuilt without a word
        assert messages == []
    else:
        assert len(messages) == 1 and "rebuilding" in messages[0], messages
    # the rebuilt library is this user's, with its digest
    st = lib.stat()
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022
    digest = _libcache.digest_path(lib).read_text().strip()
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == digest


def test_sticky_ancestor_and_safe_cache_load_without_a_rebuild(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, good_library: Path
) -> None:
    sticky = fresh / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp
    monkeypatch.setenv("DYNAMIQ_CACHE", str(sticky / "cache"))
    _plant(sticky / "cache" / "cpu-kernels", good_library.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_native.available()
    assert _calls(fresh) == 0 and _encodes()


def test_unsafe_reason_names_the_problem(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True)
    assert _libcache.unsafe_reason(d) is None
    (tmp_path / "a").chmod(0o1777)  # a sticky ancestor
    assert _libcache.unsafe_reason(d) is None
    d.chmod(0o1777)  # the cache directory itself may not be sticky-writable
    assert "is writable by others" in str(_libcache.unsafe_reason(d))
    d.chmod(0o775)
    assert "writable by its group" in str(_libcache.unsafe_reason(d))
    d.chmod(0o755)
    os.chown(tmp_path / "a", NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}" in str(_libcache.unsafe_reason(d))


# -- damaged files and concurrent builds, in fresh processes --------------------------------

_CHILD = """\
import hashlib, warnings
from dynamiq.kernels import cpu_native
warnings.simplefilter("default")
assert cpu_native.available(), "kernels unavailable"
import torch
from dynamiq import get_codec
from dynamiq.kernels import encode
x = torch.linspace(-3, 5, cpu_native.MIN_NUMEL)
payload = bytes(encode(get_codec("int8"), x, backend="cpu").numpy())
print(hashlib.sha256(payload).hexdigest(), cpu_native.library_path())
"""


def _child_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "DYNAMIQ_CACHE": str(cache), "OMP_NUM_THREADS": "1"}


def test_truncated_library_is_rebuilt_in_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, good_library: Path
) -> None:
    """A library cut short after its digest was recorded (a full disk, a killed copy): the
    next process rebuilds it instead of dying with SIGBUS inside dlopen."""
    cache = fresh / "cache"
    monkeypatch.setenv("DYNAMIQ_CACHE", str(cache))
    data = good_library.read_bytes()
    lib = _plant(cache / "cpu-kernels", data)
    with open(lib, "r+b") as f:
        f.truncate(len(data) // 3)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=_child_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # < 0: a signal
    assert "rebuilding" in proc.stderr and "does not match its recorded SHA-256" in proc.stderr
    assert lib.read_bytes() == data and _calls(fresh) == 1
    assert proc.stdout.split()[0] == hashlib.sha256(_encodes()).hexdigest()


def test_four_processes_building_at_once_load_one_whole_library(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, good_library: Path
) -> None:
    """Four processes start on an empty cache at once; the build writes its output slowly
    (half, a second's pause, the rest). None may load a partial file: all succeed with the
    same result, and the library is built once."""
    monkeypatch.setenv("CXX", str(_fake_cxx(fresh, good_library, slow=True)))
    cache = fresh / "cache"
    env = _child_env(cache)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (p.returncode, err[-3000:])
    assert len({out for out, _ in outs}) == 1, outs
    assert _calls(fresh) == 1
    lib = Path(outs[0][0].split()[1])
    assert lib.read_bytes() == good_library.read_bytes()
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted(
        [lib.name, lib.name + ".sha256", lib.name + ".lock"]
    )  # no temporary file left behind


def test_a_build_says_so_on_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build takes tens of seconds: it announces itself (with where it goes) before it
    starts, so a first call is not a silent hang; the compiler itself is stubbed out here."""
    calls: list[Path] = []
    monkeypatch.setattr(cpu_native, "_compile", lambda cxx, dest, include: calls.append(dest))
    dest = tmp_path / "lib.so"
    cpu_native._build("c++", dest)
    err = capsys.readouterr().err
    assert calls == [dest]
    assert "building the native CPU kernels" in err and str(dest) in err
