"""The native CPU kernels never read or write past the tensors they are given.

An out-of-bounds access a byte or two past a buffer is invisible to bit-exactness tests (the
bytes beyond are usually mapped heap) but crashes a process when the buffer ends at a page
boundary. Here every input (values, payload, local values) is placed so that its last byte is
the last byte of a page whose successor is mapped ``PROT_NONE``: an overread is then a
SIGSEGV. The checks run in a child process, so an overread fails this test instead of killing
pytest; they also compare each result with the codec's PyTorch reference, bit for bit.

(This found ``unpack``'s 8-byte loads reading up to 7 bytes past a code stream shorter than 8
bytes: C++ division truncates toward zero, so ``(nbytes - 8) / BITS + 1`` was 1, not 0.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dynamiq.kernels import cpu_native

if cpu_native._compiler() is None:
    pytest.skip("no C++ compiler: the native CPU kernels cannot be built here",
                allow_module_level=True)  # fmt: skip
if not sys.platform.startswith("linux"):
    pytest.skip("guard pages via mmap/mprotect are set up for Linux", allow_module_level=True)

CHILD = textwrap.dedent(
    r"""
    import ctypes, mmap, sys
    import torch
    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext, get_codec, list_codecs
    from dynamiq.codecs.intq import IntCodec
    from dynamiq.kernels import cpu_native

    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    KEEP = []

    def guarded(src):
        # a copy of the 1-D tensor src whose last byte is the last byte before a PROT_NONE page
        raw = src.contiguous().view(torch.uint8)
        nbytes = raw.numel()
        pages = nbytes // PAGE + 2
        m = mmap.mmap(-1, pages * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if libc.mprotect(base + (pages - 1) * PAGE, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        KEEP.append(m)
        start = (pages - 1) * PAGE - nbytes
        out = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)
        out.copy_(raw)
        return out.view(src.dtype)

    def same(a, b):
        if a.dtype == torch.uint8:
            return torch.equal(a, b)
        return torch.equal(a.view(torch.int32), b.view(torch.int32)) or bool(
            torch.equal(torch.isnan(a), torch.isnan(b))
            and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
        )

    codecs = [c for c in map(get_codec, list_codecs()) if cpu_native._family(c) is not None]
    codecs += [IntCodec(bits=b, block_size=bs) for b in (3, 5, 6, 7) for bs in (4, 12, 32)]
    sizes = [*range(1, 18), 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000]
    gen = torch.Generator().manual_seed(0)
    ctx = HopContext()
    # then several threads on short tiles: ranges of tiles split unevenly (4 tiles of 16384
    # pass-through values on 3 threads once gave one thread an empty range, and a memcpy of
    # a negative size)
    dtypes = (torch.float32, torch.bfloat16)
    cases = [(1, dtypes[i % 2], n) for i, n in enumerate(sizes)]
    cases += [(3, torch.float32, n) for n in (200, 1000)]
    long = [(3, torch.float32, 3 * 16384 + 5)]  # pass-through only (its tiles; the others'
    cpu_native._PER_THREAD = 64  # references are slow there)
    checked = 0
    for codec in codecs:
        passthrough = cpu_native._family(codec) == "passthrough"
        for threads, dtype, n in cases + long if passthrough else cases:
            torch.set_num_threads(threads)
            x = (torch.randn(n, generator=gen) * 3).to(dtype)
            local = (torch.randn(n, generator=gen) * 3).to(dtype)
            what = f"{codec.codec_id} {dtype} n={n} threads={threads}"
            want = codec._encode(x, ctx)
            got = K.encode(codec, guarded(x), ctx, "cpu")
            assert same(got, want), f"{what}: encode differs"
            dec = K.decode(codec, guarded(want), n, ctx, "cpu")
            assert same(dec, codec._decode(want, n, ctx)), f"{what}: decode differs"
            red = K.reduce(codec, guarded(want), guarded(local), ctx, ctx, "cpu")
            assert same(red, codec._reduce(want, local, ctx, ctx)), f"{what}: reduce differs"
            checked += 1
    print("checked", checked)
    """
)


def test_no_kernel_reads_or_writes_past_its_buffers() -> None:
    env = {**os.environ, "DYNAMIQ_CPU_KERNELS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (-11 is SIGSEGV: a kernel touched a guard page)"
        f"\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    )
    assert "checked" in proc.stdout
    assert int(proc.stdout.split("checked")[-1]) > 500


def test_sanitized_build_is_its_own_cache_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DYNAMIQ_CPU_SANITIZE=address`` (``make sanitize``) compiles with AddressSanitizer into
    a library of its own name; an unknown mode is an error naming it, not a silent build."""
    monkeypatch.delenv("DYNAMIQ_CPU_SANITIZE", raising=False)
    plain = cpu_native.library_path("g++")
    assert "-fsanitize=address" not in cpu_native._flags()[0]
    monkeypatch.setenv("DYNAMIQ_CPU_SANITIZE", "address")
    flags, link = cpu_native._flags()
    assert "-fsanitize=address" in flags and "-fsanitize=address" in link
    assert "-O3" not in flags and "-ffp-contract=off" in flags
    assert cpu_native.library_path("g++") != plain
    monkeypatch.setenv("DYNAMIQ_CPU_SANITIZE", "thread-ish")
    with pytest.raises(RuntimeError, match="DYNAMIQ_CPU_SANITIZE='thread-ish'"):
        cpu_native._flags()
