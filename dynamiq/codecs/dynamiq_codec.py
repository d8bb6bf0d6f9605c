"""The DynamiQ codec (spec/dynamiq-codec.md): partial-sum-aware quantization for multi-hop
all-reduce.

Wire unit: a **span** of ``span`` values (the codec's ``block_size``, aligned to global
offsets) made of **super-groups** of ``super_group`` values, each made of **groups** of
``group`` values. Per span, the wire holds:

1. one scale per super-group: ``S = roundup_bf16(absmax)`` (bf16, 2 bytes);
2. one 4-bit code ``e`` per group: the group scale is ``s = S·2^-e``, the largest such
   power-of-two step below ``S`` that is still >= the group's absmax (``e`` in 0..15);
3. the groups' level indices, ``w_g`` bits each, packed back to back in a fixed container of
   ``floor(bits_k · len)`` bits (``len`` the span's length).

**Variable bit-width, no extra metadata.** The widths ``w_g`` are not sent: both sides derive
them from the integer scale codes by reverse water-filling over the whole span (the budget is
pooled over the span). The next bit of group ``g`` at width ``w`` is worth
``s_g^2 (D(w) - D(w+1))``, ``D`` the distortion of the fitted level tables measured on the fit
split; in integers, ``P[g, w] = 8 L_g + Q[w]`` with ``L_g = k floor(log2 S) - e_g`` (the
group scale's log2 in 1/k-bit units) and ``Q[w] = round(4k log2(D(w) - D(w+1)))``. Every bit
worth at least the lowest threshold that fits the budget is taken; the bits worth one less go
to the groups in index order while they fit. Integer arithmetic only: sender and receiver
agree on every device.

**Levels.** A width ``w >= 1`` has ``2^w`` levels in [-1, 1], symmetric: ``"fitted"``
(default) are Lloyd-Max tables fitted to normalised real partial sums of the ``fit`` split
(stretched to endpoints ±1 under stochastic rounding, so that rounding stays unbiased),
disjoint from the evaluation data (``benchmarks/fit_levels.py`` writes
``_dynamiq_levels.py``); ``"uniform"`` are evenly spaced with endpoints ±1. A value is
``level · s``; width 0 decodes to 0.

**Rounding.** ``"nearest"`` (lowest error per hop, biased), ``"stochastic"`` (between the
two neighbouring levels, unbiased, dither from the counter hash of (seed, step, hop, rank,
index)), or ``"correlated"``: the dither of coordinate ``j`` at hop ``k`` is ``u = (π_j(k) +
v) / H`` with ``π_j`` a per-coordinate cyclic shift of the ``H = ctx.num_hops`` hops (shared
by every hop and rank through the seed) and ``v`` uniform: each hop is unbiased, and the
errors of successive hops are stratified, so they partly cancel in the final sum.

**Partial-sum awareness.** ``hop_slope`` moves bits from early hops to late ones, whose
partial sums are larger: ``bits_k = bits + hop_slope · (k - (H - 1)/2) / max(H - 1, 1)``, so
the average over the hops stays ``bits`` (the wire size depends on ``ctx``, as allowed).

Non-finite input: a super-group holding NaN or ±Inf gets a NaN scale and decodes to NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ._dynamiq_levels import DISTORTION_FITTED, LEVELS
from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .formats import exponent_of
from .hashing import hash_keys, hash_u32, uniform_open01
from .registry import register_codec

__all__ = ["DynamiqCodec", "level_table"]


def _priority(k: int) -> tuple[int, ...]:
    """round(4k log2(D(w) - D(w + 1))) for w = 0..7 (integers shared by both sides)."""
    d = DISTORTION_FITTED
    return tuple(round(4 * k * math.log2(d[w] - d[w + 1])) for w in range(8))


_PRIORITY = {k: _priority(k) for k in range(1, 5)}

_MAX_W = 8
_E_MAX = 15  # group codes are 4 bits


def level_table(kind: str, width: int) -> torch.Tensor:
    """The ``2^width`` levels (fp32, ascending, within [-1, 1]) of a width; empty for 0."""
    if width == 0:
        return torch.zeros(0)
    if kind == "fitted":
        half = torch.tensor(LEVELS[width], dtype=torch.float32)
        return torch.cat([-half.flip(0), half])
    n = 1 << width
    k = torch.arange(n, dtype=torch.float64)
    return (2 * k / (n - 1) - 1).float()


def _max_error_units(levels: torch.Tensor, stochastic: bool) -> float:
    """Largest |level - y| for y in [-1, 1] (nearest), or the largest gap (stochastic), in
    units of the group scale."""
    if levels.numel() == 0:
        return 1.0
    lv = levels.double()
    gaps = lv[1:] - lv[:-1] if lv.numel() > 1 else torch.zeros(1, dtype=torch.float64)
    ends = max(float(lv[0] + 1), float(1 - lv[-1]))
    inner = float(gaps.max()) if stochastic else float(gaps.max()) / 2
    return max(inner, ends)


@register_codec
@dataclass(frozen=True, kw_only=True)
class DynamiqCodec(Codec):
    """Partial-sum-aware span quantizer (see the module docstring for the design).

    Error bound per element of a group with scale ``s`` (``S·2^-e``) and width ``w`` derived
    from the span's scale codes, ``m_w`` the largest distance from a point of [-1, 1] to its
    nearest level (nearest) or the largest level gap (stochastic, correlated)::

        w = 0:  |x̂ - x| <= absmax_g
        w > 0:  |x̂ - x| <= s · (m_w + 2^-22)

    (the ``2^-22`` covers the fp32 rounding of ``x / s`` and of ``level · s``).
    """

    codec_id: ClassVar[str] = "dynamiq"
    nonfinite: ClassVar[str] = (
        "A super-group holding NaN or ±Inf gets a NaN scale and decodes to NaN."
    )

    bits: float = 4.7
    span: int = 65536
    super_group: int = 1024
    group: int = 16
    levels: str = "fitted"
    rounding: str = "nearest"
    hop_slope: float = 0.0
    pooled: bool = True
    scale_steps: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise TypeError(f"bits must be a number (got {type(self.bits).__name__})")
        if not 0.5 <= self.bits <= 8:
            raise ValueError(f"bits must be in 0.5..8 (got {self.bits})")
        check_int("group", self.group, 2, 256)
        check_int("super_group", self.super_group, self.group, 1 << 16)
        check_int("span", self.span, self.super_group, 1 << 20)
        if self.super_group % self.group or self.span % self.super_group:
            raise ValueError(
                f"span ({self.span}) must be a multiple of super_group ({self.super_group}), "
                f"itself a multiple of group ({self.group})"
            )
        check_choice("levels", self.levels, ("fitted", "uniform"))
        check_choice("rounding", self.rounding, ("nearest", "stochastic", "correlated"))
        if not isinstance(self.hop_slope, (int, float)) or not 0 <= self.hop_slope <= 4:
            raise ValueError(f"hop_slope must be in 0..4 (got {self.hop_slope})")
        check_int("scale_steps", self.scale_steps, 1, 4)
        if not isinstance(self.pooled, bool):
            raise TypeError(f"pooled must be a bool (got {self.pooled!r})")

    @property
    def block_size(self) -> int:
        return self.span

    def _levels(self, width: int) -> torch.Tensor:
        """The level table of a width; for stochastic and correlated rounding stretched to
        endpoints ±1, so that every value lies between two levels (unbiased rounding)."""
        lv = level_table(self.levels, width)
        if self.rounding != "nearest" and lv.numel():
            lv = lv / lv.abs().max()
        return lv

    @property
    def max_input_abs(self) -> float:
        return 2.0**127

    # -- sizes --------------------------------------------------------------------------

    def _bits_at(self, ctx: HopContext | None) -> float:
        if ctx is None or ctx.num_hops <= 1 or self.hop_slope == 0:
            return float(self.bits)
        rel = (ctx.hop - (ctx.num_hops - 1) / 2) / (ctx.num_hops - 1)
        return min(8.0, max(0.0, self.bits + self.hop_slope * rel))

    def _budget(self, length: int, ctx: HopContext | None) -> int:
        return math.floor(self._bits_at(ctx) * length)

    def _span_bytes(self, length: int, ctx: HopContext | None) -> int:
        n_sg = -(-length // self.super_group)
        n_g = -(-length // self.group)
        return 2 * n_sg + (n_g * 4 + 7) // 8 + (self._budget(length, ctx) + 7) // 8

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        full, rest = divmod(numel, self.span)
        return full * self._span_bytes(self.span, ctx) + (
            self._span_bytes(rest, ctx) if rest else 0
        )

    # -- statistics -----------------------------------------------------------------------

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(super-group scales S [n_sg], group codes e [n_g], group absmax [n_g]) of one span."""
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
        # e: the largest code in 0..15 whose group scale s(S, e) is still >= a_g; s is
        # evaluated exactly as the decoder will, so s >= a_g holds for the chosen e
        cand = self._group_scale(s_of_g.unsqueeze(1), torch.arange(_E_MAX + 1, device=x.device))
        ok = cand >= a_g.unsqueeze(1)
        e = (ok.to(torch.int64) * torch.arange(1, _E_MAX + 2, device=x.device)).amax(dim=1) - 1
        e = torch.where(a_g == 0, _E_MAX, e.clamp(0, _E_MAX))
        return s_sg, e, a_g

    def _group_scale(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``fl32(S · 2^(-(e mod k)/k)) · 2^-(e div k)`` with ``k = scale_steps`` (fp32)."""
        k = self.scale_steps
        steps = torch.tensor(
            [2.0 ** (-j / k) for j in range(k)], dtype=torch.float32, device=s.device
        )
        return torch.ldexp(s * steps[e % k], -(e // k))

    def _widths(
        self, s_sg: torch.Tensor, e: torch.Tensor, length: int, budget: int
    ) -> torch.Tensor:
        """Bits per element of each group, from integer scale codes only (both sides)."""
        g = self.group
        n_g = e.numel()
        sizes = torch.full((n_g,), g, dtype=torch.int64, device=e.device)
        if n_g:
            sizes[-1] = length - g * (n_g - 1)
        per_sg = self.super_group // g
        es = exponent_of(s_sg).repeat_interleave(per_sg)[:n_g]
        k = self.scale_steps
        level = k * es - e  # log2 of the group scale, in units of 1/k bit (integer)
        live = (s_sg.repeat_interleave(per_sg)[:n_g] > 0) & (e < _E_MAX + 1)
        if not self.pooled:
            # ablation: every group gets the same width (no variable bit-width)
            flat = min(_MAX_W, budget // max(length, 1))
            return torch.where(live, flat, 0).to(torch.int64)
        if not bool(live.any()):
            return torch.zeros(n_g, dtype=torch.int64, device=e.device)
        # reverse water-filling by marginal gain: the next bit of group g at width w is worth
        # s_g^2 (D(w) - D(w + 1)), D the fitted tables' distortion; in integers, 4k log2 of it:
        # P[g, w] = 8 L_g + Q[w], decreasing in w; widths are the counts of P >= tau for the
        # smallest tau that fits the budget
        q = torch.tensor(_PRIORITY[k], dtype=torch.int64, device=e.device)
        prio = torch.where(live.unsqueeze(1), 8 * level.unsqueeze(1) + q, -(1 << 40))

        def cost(tau: int) -> int:
            return int(((prio >= tau).sum(dim=1) * sizes).sum())

        lo, hi = int(prio[live].min()), int(prio[live].max()) + 1  # cost(hi) = 0 <= budget
        while lo < hi:  # smallest tau with cost(tau) <= budget
            mid = (lo + hi) // 2
            if cost(mid) <= budget:
                hi = mid
            else:
                lo = mid + 1
        tau = lo
        w = (prio >= tau).sum(dim=1)
        # leftover bits: raise the groups whose next bit is worth tau - 1, in index order
        left = budget - int((w * sizes).sum())
        nxt = torch.gather(prio, 1, w.clamp(max=_MAX_W - 1).unsqueeze(1)).squeeze(1)
        rising = (w < _MAX_W) & (nxt == tau - 1)
        cum = torch.cumsum(torch.where(rising, sizes, 0), dim=0)
        return w + (rising & (cum <= left)).to(torch.int64)

    # -- encode / decode ----------------------------------------------------------------

    def _span_ctx_u(self, idx: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        """The dither of each coordinate (global indices ``idx``) at this hop."""
        v = uniform_open01(hash_u32(idx, hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)))
        if self.rounding == "stochastic" or ctx.num_hops <= 1:
            return v
        h = ctx.num_hops
        # per-coordinate cyclic shift of the hops, shared by all hops and ranks
        shift = hash_u32(idx, hash_keys(ctx.seed, ctx.step, 0xFFFFFFFF, 0xFFFFFFFF)) % h
        stratum = (shift + ctx.hop) % h
        return (stratum.to(torch.float32) + v) / h

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        xf = x.float()
        out = []
        for a in range(0, xf.numel(), self.span):
            out.append(self._encode_span(xf[a : a + self.span], ctx, ctx.offset + a))
        if not out:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return torch.cat(out)

    def _encode_span(self, x: torch.Tensor, ctx: HopContext, offset: int) -> torch.Tensor:
        n = x.numel()
        s_sg, e, _ = self._scales(x)
        finite_sg = torch.isfinite(s_sg)
        budget = self._budget(n, ctx)
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
        header = torch.cat(
            [
                s_sg.to(torch.bfloat16).view(torch.uint8),
                _pack4(e),
            ]
        )
        body = _pack_varwidth(code, w_el, budget)
        return torch.cat([header, body])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        pos = 0
        for a in range(0, numel, self.span):
            n = min(self.span, numel - a)
            size = self._span_bytes(n, ctx)
            out[a : a + n] = self._decode_span(payload[pos : pos + size], n, ctx)
            pos += size
        return out

    def _decode_span(self, p: torch.Tensor, n: int, ctx: HopContext) -> torch.Tensor:
        g, per_sg = self.group, self.super_group // self.group
        n_sg, n_g = -(-n // self.super_group), -(-n // g)
        s_sg = p[: 2 * n_sg].clone().view(torch.bfloat16).float()
        e = _unpack4(p[2 * n_sg : 2 * n_sg + (n_g * 4 + 7) // 8], n_g)
        budget = self._budget(n, ctx)
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

    # -- error bound --------------------------------------------------------------------

    @property
    def error_bound(self) -> ErrorBound:
        stochastic = self.rounding != "nearest"
        units = [_max_error_units(self._levels(w), stochastic) for w in range(_MAX_W + 1)]
        g, per_sg = self.group, self.super_group // self.group

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            xf = x.float()
            out = torch.empty(xf.numel(), dtype=torch.float64, device=x.device)
            for a in range(0, xf.numel(), self.span):
                xs = xf[a : a + self.span]
                n = xs.numel()
                s_sg, e, a_g = self._scales(xs)
                w = self._widths(
                    torch.where(torch.isfinite(s_sg), s_sg, 0.0), e, n, self._budget(n, ctx)
                )
                s_g = self._group_scale(s_sg.repeat_interleave(per_sg)[: e.numel()], e).double()
                unit = torch.tensor(units, dtype=torch.float64, device=x.device)[w]
                b = torch.where(w == 0, a_g.double(), s_g * (unit + 2.0**-22))
                b = torch.where(torch.isfinite(b), b, torch.inf)
                out[a : a + n] = b.repeat_interleave(g)[:n]
            return out

        def witness(numel: int) -> torch.Tensor:
            # equal group scales, so every group gets the same width; values sit where the
            # level table is farthest from its levels (a gap's midpoint, or a gap's edge)
            w = min(_MAX_W, max(1, int(self._bits_at(None))))
            lv = self._levels(w).double()
            gaps = lv[1:] - lv[:-1]
            i = int(gaps.argmax())
            point = float(lv[i] + gaps[i] / 2) if not stochastic else float(lv[i] + gaps[i] * 0.75)
            k = torch.arange(numel)
            x = torch.full((numel,), point, dtype=torch.float64)
            x[k % g == 0] = 1.0
            return x.float()

        formula = (
            "s·(m_w + 2^-22) (w > 0), absmax_g (w = 0); s = S·2^-e, w from the span's scale codes"
        )
        return ErrorBound(
            formula=formula, unbiased=stochastic, max_abs=max_abs, witness=witness, var=None
        )


def _quantize(y: torch.Tensor, levels: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Index of the level for each y in [-1, 1]: nearest (ties to the lower level), or
    between the two neighbours with probability proportional to closeness (``u`` uniform)."""
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
    """Codes of varying widths back to back (LSB first) in a container of ``budget`` bits."""
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
    if width.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=p.device)
    bits = ((p.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=p.device)) & 1).reshape(-1)
    start = torch.cumsum(width, 0) - width
    j = torch.arange(_MAX_W, device=p.device)
    valid = j.unsqueeze(0) < width.unsqueeze(1)
    pos = (start.unsqueeze(1) + j.unsqueeze(0)).clamp(max=max(bits.numel() - 1, 0))
    vals = torch.where(valid, bits[pos] << j.unsqueeze(0), 0)
    return vals.sum(dim=1)
