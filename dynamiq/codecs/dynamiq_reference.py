"""The normative, readable definition of the DynamiQ wire format (docs/formats.md, "DynamiQ").

:class:`DynamiqReference` encodes, decodes, reduces and bounds one span at a time, written
the way the format is defined: the super-group scales and group codes of the span, its
groups' widths by reverse water-filling of the span's budget (a binary search of the
threshold, one host read per step), the level indices with one boolean mask per width,
then bit-by-bit packing. It is slow by design (the first, span-by-span implementation, kept
in logic) and meant to be read and run on the CPU. **Every other path must be bit-exact with
it** (the same wire bytes, decoded values, reduced payloads and ``max_abs_error``): the
batched PyTorch codec (:meth:`DynamiqCodec._encode`, ``_decode``, ``_reduce``:
``dynamiq/codecs/dynamiq_codec.py``), its block functions as ``torch.compile`` compiles them
(``DYNAMIQ_CPU_COMPILE=1``), the Triton kernels (``dynamiq/kernels/dynamiq.py``) and the
native C++ kernels (``dynamiq/kernels/csrc/dynamiq_kernels.cpp``). The tests that hold them
to it: ``tests/codecs/test_dynamiq_codec.py`` (the batched codec, every knob) and
``tests/codecs/test_dynamiq_reference.py`` (the default configuration with a real prologue
result, on every backend).

**The budget of a span.** With ``pooling="bucket"`` (the default) and the prologue's result
in ``ctx.shared`` (under :data:`~dynamiq.codecs._dynamiq_pool.SHARED_KEY`), every span's
budget is the prologue's: :func:`~dynamiq.codecs._dynamiq_pool.chunk_budgets` gives the
container bytes of the spans of a chunk at ``ctx.offset`` (``B`` is 8 times that), what the
batched codec reads too; inside the span its own water-filling shares ``B`` among its groups
as in the span design. Otherwise (``pooling="span"``, or no result in the context) a span of
``len`` values gets ``floor(bits_k · len)`` bits. What the prologue computes before any span
is encoded is not span-by-span and is not restated here: each rank's demand
(:func:`~dynamiq.codecs._dynamiq_pool.span_statistics`: one water-filling over the rank's
whole buffer), the sharing of the bucket's bytes among all its spans
(:func:`~dynamiq.codecs._dynamiq_pool.span_budgets`), and the re-cut of an all-reduce's
chunks to equal bytes (:func:`~dynamiq.codecs._dynamiq_pool.recut`); their definition is
``dynamiq/codecs/_dynamiq_pool.py`` (integer arithmetic on the agreed demand; for 256 spans
or more its sharing runs in the bit-exact native kernel where one is built). Given their
result, every span is encoded on its own.

Not part of the wire, so not here: the input range check (a finite ``|x|`` beyond
``max_input_abs`` raises in the codec or its prologue; here its super-group scale would be
infinite). The reference reads only the codec's configuration fields, never its methods (the
prologue's budgets through ``_dynamiq_pool``, which reads the codec's ``span`` and
``balance``); the data both share (level tables, the integer priorities, a table's error
units) come from the codec's module. ``dynamiq.codecs`` does not import this module::

    from dynamiq.codecs.dynamiq_reference import DynamiqReference
"""

from __future__ import annotations

import math

import torch

from dynamiq.codecs import _dynamiq_pool as _pool
from dynamiq.codecs.base import HopContext
from dynamiq.codecs.dynamiq_codec import _PRIORITY, DynamiqCodec, _max_error_units
from dynamiq.codecs.dynamiq_codec import level_table as _level_table
from dynamiq.codecs.formats import exponent_of
from dynamiq.codecs.hashing import hash_keys, hash_u32, uniform_open01

__all__ = ["DynamiqReference"]

_MAX_W = 8
_E_MAX = 15


class DynamiqReference:
    """The DynamiQ codec of one configuration, span by span (``encoded_nbytes``, ``budgets``,
    ``encode``, ``decode``, ``reduce``, ``max_abs``), built from a :class:`DynamiqCodec`'s
    fields."""

    def __init__(self, codec: DynamiqCodec) -> None:
        self.bits = codec.bits
        self.span = codec.span
        self.super_group = codec.super_group
        self.group = codec.group
        self.levels = codec.levels
        self.rounding = codec.rounding
        self.hop_slope = codec.hop_slope
        self.pooled = codec.pooled
        self.scale_steps = codec.scale_steps
        self.pooling = codec.pooling
        # the prologue's budgets are read through _dynamiq_pool, which takes the codec (it
        # reads its span and balance fields)
        self._codec = codec

    def _levels(self, width: int) -> torch.Tensor:
        lv = _level_table(self.levels, width)
        if self.rounding != "nearest" and lv.numel():
            lv = lv / lv.abs().max()
        return lv

    def _bits_at(self, ctx: HopContext | None) -> float:
        if ctx is None or ctx.num_hops <= 1 or self.hop_slope == 0:
            return float(self.bits)
        rel = (ctx.hop - (ctx.num_hops - 1) / 2) / (ctx.num_hops - 1)
        return min(8.0, max(0.0, self.bits + self.hop_slope * rel))

    # -- the budget B of each span ----------------------------------------------------------

    def budgets(self, numel: int, ctx: HopContext | None = None) -> list[int]:
        """The budget ``B`` (bits) of each span of the ``numel`` values at ``ctx.offset``:
        the prologue's, when the codec pools over the bucket and ``ctx.shared`` holds its
        result, else ``floor(bits_k · len)`` of a span of ``len`` values."""
        pooled = self._pooled_budgets(numel, ctx)
        if pooled is not None:
            return pooled
        bits = self._bits_at(ctx)
        return [math.floor(bits * min(self.span, numel - a)) for a in range(0, numel, self.span)]

    def _pooled_budgets(self, numel: int, ctx: HopContext | None) -> list[int] | None:
        """Each span's budget (bits: 8 times its container bytes) from the prologue's result
        in ``ctx.shared``, or ``None`` (``pooling="span"``, or no result)."""
        if self.pooling != "bucket" or ctx is None or ctx.shared is None:
            return None
        nbytes = _pool.chunk_budgets(self._codec, ctx.shared, numel, ctx.offset, self._bits_at(ctx))
        return None if nbytes is None else [8 * int(b) for b in nbytes]

    def _spans(self, numel: int, ctx: HopContext | None) -> list[tuple[int, int, int]]:
        """``(first value, length, budget)`` of each span of ``numel`` values."""
        starts = range(0, numel, self.span)
        budgets = self.budgets(numel, ctx)
        if len(budgets) != len(starts):
            raise ValueError(f"dynamiq: {len(budgets)} span budgets for {len(starts)} spans")
        return [(a, min(self.span, numel - a), b) for a, b in zip(starts, budgets, strict=True)]

    def _span_bytes(self, length: int, budget: int) -> int:
        n_sg = -(-length // self.super_group)
        n_g = -(-length // self.group)
        return 2 * n_sg + (n_g * 4 + 7) // 8 + (budget + 7) // 8

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return sum(self._span_bytes(n, b) for _, n, b in self._spans(numel, ctx))

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.numel()
        g, sg = self.group, self.super_group
        n_g = -(-n // g)
        pad = torch.zeros(n_g * g, dtype=torch.float32, device=x.device)
        pad[:n] = x
        a_g = pad.view(n_g, g).abs().amax(dim=1)
        per_sg = sg // g
        n_sg = -(-n_g // per_sg)
        a_pad = torch.zeros(n_sg * per_sg, dtype=torch.float32, device=x.device)
        a_pad[:n_g] = a_g
        a_sg = a_pad.view(n_sg, per_sg).amax(dim=1)
        s = a_sg.to(torch.bfloat16)
        s = torch.where(s.float() < a_sg, (s.view(torch.int16) + 1).view(torch.bfloat16), s)
        s_sg = s.float()
        s_of_g = s_sg.repeat_interleave(per_sg)[:n_g]
        cand = self._group_scale(s_of_g.unsqueeze(1), torch.arange(_E_MAX + 1, device=x.device))
        ok = cand >= a_g.unsqueeze(1)
        e = (ok.to(torch.int64) * torch.arange(1, _E_MAX + 2, device=x.device)).amax(dim=1) - 1
        e = torch.where(a_g == 0, _E_MAX, e.clamp(0, _E_MAX))
        return s_sg, e, a_g

    def _group_scale(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        k = self.scale_steps
        steps = torch.tensor(
            [2.0 ** (-j / k) for j in range(k)], dtype=torch.float32, device=s.device
        )
        return torch.ldexp(s * steps[e % k], -(e // k))

    def _widths(
        self, s_sg: torch.Tensor, e: torch.Tensor, length: int, budget: int
    ) -> torch.Tensor:
        g = self.group
        n_g = e.numel()
        sizes = torch.full((n_g,), g, dtype=torch.int64, device=e.device)
        if n_g:
            sizes[-1] = length - g * (n_g - 1)
        per_sg = self.super_group // g
        es = exponent_of(s_sg).repeat_interleave(per_sg)[:n_g]
        k = self.scale_steps
        level = k * es - e
        live = (s_sg.repeat_interleave(per_sg)[:n_g] > 0) & (e < _E_MAX + 1)
        if not self.pooled:
            flat = min(_MAX_W, budget // max(length, 1))
            return torch.where(live, flat, 0).to(torch.int64)
        if not bool(live.any()):
            return torch.zeros(n_g, dtype=torch.int64, device=e.device)
        q = torch.tensor(_PRIORITY[k], dtype=torch.int64, device=e.device)
        prio = torch.where(live.unsqueeze(1), 8 * level.unsqueeze(1) + q, -(1 << 40))

        def cost(tau: int) -> int:
            return int(((prio >= tau).sum(dim=1) * sizes).sum())

        lo, hi = int(prio[live].min()), int(prio[live].max()) + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(mid) <= budget:
                hi = mid
            else:
                lo = mid + 1
        tau = lo
        w = (prio >= tau).sum(dim=1)
        left = budget - int((w * sizes).sum())
        nxt = torch.gather(prio, 1, w.clamp(max=_MAX_W - 1).unsqueeze(1)).squeeze(1)
        rising = (w < _MAX_W) & (nxt == tau - 1)
        cum = torch.cumsum(torch.where(rising, sizes, 0), dim=0)
        return w + (rising & (cum <= left)).to(torch.int64)

    def _span_ctx_u(self, idx: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        v = uniform_open01(hash_u32(idx, hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)))
        if self.rounding == "stochastic" or ctx.num_hops <= 1:
            return v
        h = ctx.num_hops
        shift = hash_u32(idx, hash_keys(ctx.seed, ctx.step, 0xFFFFFFFF, 0xFFFFFFFF)) % h
        stratum = (shift + ctx.hop) % h
        # divided by a tensor: an IEEE division on every device (as the codec does)
        num = stratum.to(torch.float32) + v
        return num / torch.full_like(num, float(h))

    def encode(self, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
        """The wire bytes of ``x`` (its spans' back to back)."""
        ctx = HopContext() if ctx is None else ctx
        xf = x.float().reshape(-1)
        out = [
            self._encode_span(xf[a : a + n], ctx, ctx.offset + a, budget)
            for a, n, budget in self._spans(xf.numel(), ctx)
        ]
        if not out:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return torch.cat(out)

    def _encode_span(
        self, x: torch.Tensor, ctx: HopContext, offset: int, budget: int
    ) -> torch.Tensor:
        n = x.numel()
        s_sg, e, _ = self._scales(x)
        finite_sg = torch.isfinite(s_sg)
        w = self._widths(torch.where(finite_sg, s_sg, 0.0), e, n, budget)
        g, per_sg = self.group, self.super_group // self.group
        s_g = self._group_scale(s_sg.repeat_interleave(per_sg)[: e.numel()], e)
        s_el = s_g.repeat_interleave(g)[:n]
        w_el = w.repeat_interleave(g)[:n]
        safe = torch.where((s_el > 0) & torch.isfinite(s_el), s_el, 1.0)
        y = torch.where(s_el > 0, x / safe, 0.0).clamp(-1, 1)
        idx = torch.arange(n, device=x.device, dtype=torch.int64) + offset
        u = None if self.rounding == "nearest" else self._span_ctx_u(idx, ctx)
        code = torch.zeros(n, dtype=torch.int64, device=x.device)
        for width in range(1, _MAX_W + 1):
            m = w_el == width
            if bool(m.any()):
                code[m] = _quantize(
                    y[m], self._levels(width).to(x.device), None if u is None else u[m]
                )
        header = torch.cat([s_sg.to(torch.bfloat16).view(torch.uint8), _pack4(e)])
        body = _pack_varwidth(code, w_el, budget)
        return torch.cat([header, body])

    def decode(
        self, payload: torch.Tensor, numel: int, ctx: HopContext | None = None
    ) -> torch.Tensor:
        """The fp32 values of a payload of ``numel`` values."""
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        pos = 0
        for a, n, budget in self._spans(numel, ctx):
            size = self._span_bytes(n, budget)
            out[a : a + n] = self._decode_span(payload[pos : pos + size], n, budget)
            pos += size
        if pos != payload.numel():
            raise ValueError(f"dynamiq: a payload of {payload.numel()} bytes, want {pos}")
        return out

    def reduce(
        self,
        payload: torch.Tensor,
        local: torch.Tensor,
        ctx: HopContext | None,
        out_ctx: HopContext | None,
    ) -> torch.Tensor:
        """The fused decompress-accumulate-recompress: ``payload`` decoded under ``ctx``,
        plus ``local`` (in fp32), encoded under ``out_ctx``."""
        return self.encode(self.decode(payload, local.numel(), ctx) + local.float(), out_ctx)

    def _decode_span(self, p: torch.Tensor, n: int, budget: int) -> torch.Tensor:
        g, per_sg = self.group, self.super_group // self.group
        n_sg, n_g = -(-n // self.super_group), -(-n // g)
        s_sg = p[: 2 * n_sg].clone().view(torch.bfloat16).float()
        e = _unpack4(p[2 * n_sg : 2 * n_sg + (n_g * 4 + 7) // 8], n_g)
        finite_sg = torch.isfinite(s_sg)
        w = self._widths(torch.where(finite_sg, s_sg, 0.0), e, n, budget)
        w_el = w.repeat_interleave(g)[:n]
        code = _unpack_varwidth(p[2 * n_sg + (n_g * 4 + 7) // 8 :], w_el)
        s_g = self._group_scale(s_sg.repeat_interleave(per_sg)[:n_g], e)
        s_el = s_g.repeat_interleave(g)[:n]
        val = torch.zeros(n, dtype=torch.float32, device=p.device)
        for width in range(1, _MAX_W + 1):
            m = w_el == width
            if bool(m.any()):
                val[m] = self._levels(width).to(p.device)[code[m]]
        return val * s_el

    def max_abs(self, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
        """The error bound of each value of ``x`` (fp64; ``inf`` in a super-group holding
        NaN or ±Inf), as :attr:`DynamiqCodec.error_bound` states it."""
        stochastic = self.rounding != "nearest"
        units = [_max_error_units(self._levels(w), stochastic) for w in range(_MAX_W + 1)]
        g, per_sg = self.group, self.super_group // self.group
        xf = x.float().reshape(-1)
        out = torch.empty(xf.numel(), dtype=torch.float64, device=x.device)
        for a, n, budget in self._spans(xf.numel(), ctx):
            s_sg, e, a_g = self._scales(xf[a : a + n])
            w = self._widths(torch.where(torch.isfinite(s_sg), s_sg, 0.0), e, n, budget)
            s_g = self._group_scale(s_sg.repeat_interleave(per_sg)[: e.numel()], e).double()
            unit = torch.tensor(units, dtype=torch.float64, device=x.device)[w]
            b = torch.where(w == 0, a_g.double(), s_g * (unit + 2.0**-22) + 2.0**-149)
            lost = ~torch.isfinite(s_sg).repeat_interleave(per_sg)[: e.numel()]
            b = torch.where(torch.isfinite(b) & ~lost, b, torch.inf)
            out[a : a + n] = b.repeat_interleave(g)[:n]
        return out


def _quantize(y: torch.Tensor, levels: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    n = levels.numel()
    hi = torch.searchsorted(levels, y.contiguous()).clamp(1, n - 1)
    lo = hi - 1
    l_lo, l_hi = levels[lo], levels[hi]
    span = l_hi - l_lo
    frac = ((y - l_lo) / span).clamp(0, 1)
    up = frac > 0.5 if u is None else u < frac
    return torch.where(up, hi, lo)


def _pack4(e: torch.Tensor) -> torch.Tensor:
    n = e.numel()
    pad = torch.zeros(n + (n & 1), dtype=torch.int64, device=e.device)
    pad[:n] = e
    pair = pad.view(-1, 2)
    return (pair[:, 0] | (pair[:, 1] << 4)).to(torch.uint8)


def _unpack4(p: torch.Tensor, n: int) -> torch.Tensor:
    b = p.to(torch.int64)
    return torch.stack([b & 15, b >> 4], dim=1).reshape(-1)[:n]


def _pack_varwidth(code: torch.Tensor, width: torch.Tensor, budget: int) -> torch.Tensor:
    nbytes = (budget + 7) // 8
    if code.numel() == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=code.device)
    start = torch.cumsum(width, 0) - width
    j = torch.arange(_MAX_W, device=code.device)
    valid = j.unsqueeze(0) < width.unsqueeze(1)
    pos = (start.unsqueeze(1) + j.unsqueeze(0))[valid]
    bit = ((code.unsqueeze(1) >> j.unsqueeze(0)) & 1)[valid]
    bits = torch.zeros(nbytes * 8, dtype=torch.int64, device=code.device)
    bits[pos] = bit
    weights = 1 << torch.arange(8, device=code.device)
    return (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def _unpack_varwidth(p: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    # the one change from the first version, which raised IndexError on an empty container
    # (a span of one value with bits < 1: every width is then 0)
    if width.numel() == 0 or p.numel() == 0:
        return torch.zeros(width.numel(), dtype=torch.int64, device=p.device)
    bits = ((p.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=p.device)) & 1).reshape(-1)
    start = torch.cumsum(width, 0) - width
    j = torch.arange(_MAX_W, device=p.device)
    valid = j.unsqueeze(0) < width.unsqueeze(1)
    pos = (start.unsqueeze(1) + j.unsqueeze(0)).clamp(max=max(bits.numel() - 1, 0))
    vals = torch.where(valid, bits[pos] << j.unsqueeze(0), 0)
    return vals.sum(dim=1)
