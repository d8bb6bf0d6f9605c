"""Dense little-endian bit packing of b-bit codes (b in 1..32).

Code ``i`` occupies bits ``[i*b, (i+1)*b)`` of the payload read as one little-endian bit
stream: bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``. Two fp4 codes share a
byte (element 0 in the low nibble); four fp6 codes share three bytes. A stream of ``n`` codes
takes ``ceil(n * b / 8)`` bytes; unused high bits of the last byte are zero. Codes of 1..8
bits travel as ``uint8`` tensors; wider codes (9..32 bits, e.g. THC's widened integer sums)
are packed from and unpacked to ``int64`` tensors by the same rule.

>>> import torch
>>> pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 4)
tensor([33,  3], dtype=torch.uint8)
>>> unpack_bits(torch.tensor([33, 3], dtype=torch.uint8), 4, 3)
tensor([1, 2, 3], dtype=torch.uint8)
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "packed_nbytes", "unpack_bits"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes taken by ``numel`` codes of ``bits`` bits."""
    return (numel * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the low ``bits`` bits of each code (uint8; int64 for ``bits > 8``) into a dense
    uint8 stream."""
    n = codes.numel()
    if bits > 8:
        return _pack_wide(codes, bits)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    groups = (n + 7) // 8
    c = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    c[:n] = codes.to(torch.int64) & ((1 << bits) - 1)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (c.view(groups, 8) << shifts).sum(dim=1)  # 8 codes -> one word of 8*bits <= 56 bits
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, bits)].contiguous()


def unpack_bits(stream: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` codes as uint8 (int64 for ``bits > 8``)."""
    if bits > 8:
        return _unpack_wide(stream, bits, numel)
    if bits == 8:
        return stream[:numel].clone()
    groups = (numel + 7) // 8
    b = torch.zeros(groups * bits, dtype=torch.int64, device=stream.device)
    nbytes = packed_nbytes(numel, bits)
    b[:nbytes] = stream[:nbytes].to(torch.int64)
    byte_shifts = torch.arange(bits, device=stream.device, dtype=torch.int64) * 8
    words = (b.view(groups, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=stream.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].to(torch.uint8)


def _pack_wide(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_bits`` for 9..32-bit codes: the stream bit by bit (n * bits booleans)."""
    if bits > 32:
        raise ValueError(f"bits must be in 1..32 (got {bits})")
    n = codes.numel()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    stream = ((codes.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1)
    nbytes = packed_nbytes(n, bits)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=codes.device)
    padded[: stream.numel()] = stream
    weights = torch.arange(8, device=codes.device, dtype=torch.int64)
    return (padded.view(nbytes, 8) << weights).sum(dim=1).to(torch.uint8)


def _unpack_wide(stream: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits > 32:
        raise ValueError(f"bits must be in 1..32 (got {bits})")
    nbytes = packed_nbytes(numel, bits)
    weights = torch.arange(8, device=stream.device, dtype=torch.int64)
    stream_bits = ((stream[:nbytes].to(torch.int64).reshape(-1, 1) >> weights) & 1).reshape(-1)
    shifts = torch.arange(bits, device=stream.device, dtype=torch.int64)
    return (stream_bits[: numel * bits].view(numel, bits) << shifts).sum(dim=1)
