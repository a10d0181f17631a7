"""An fp32 value as its bf16 rounding plus a signed 16-bit remainder, bit for bit.

A bf16 weight is the top half of an fp32 pattern. Keeping only the other 16 bits of each fp32
master (``logra.master_weights=remainder``, the idea of Megatron's ``store_param_remainders``)
halves the master's memory, provided the pair (bf16 weight, int16 remainder) gives back the fp32
value exactly and the bf16 weight the forward pass uses is the *rounded* master, not a truncated
one.

Rounding rule: to nearest, ties away from zero, on the bit pattern (equivalently on the
magnitude, the sign kept). It is the rule a 16-bit remainder can invert: every bf16 value then
stands for exactly 2^16 fp32 patterns, those whose pattern differs from its own by -2^15 ..
2^15 - 1, so ``remainder = bits(x) - bits(hi)`` fits an int16. Round-to-nearest-even (torch's
``.to(torch.bfloat16)``) cannot be inverted this way: at a tie it sends both neighbours
``(u, 0x8000)`` and ``(u - 1, 0x8000)`` to the even ``u``, so an even bf16 value stands for
2^16 + 1 patterns. The two rules differ only at exact ties (low half ``0x8000``); every master
mode rounds with :func:`round_to_bf16` so that all of them give the same bf16 weights.

Exact for every fp32 pattern that is not a NaN: normal and subnormal values, both zeros,
infinities, and values whose rounding carries into the next binade (``0x3F7FFFFF`` rounds to
``1.0``; the largest finite values round to infinity, their remainder holding the way back). A
NaN rounds to a NaN and comes back as a NaN (not necessarily the same one). Integer arithmetic
on int32 views and exact casts only: the result is the same on every device.

Shapes: any; ``hi`` and ``remainder`` have the shape of ``x``.
"""

from __future__ import annotations

import torch

_HALF_ULP = 2**15
"""Half a bf16 unit in the last place, in the fp32 pattern's low half."""
_HIGH_HALF = -(2**16)
"""Mask of the top 16 bits (0xFFFF0000 as a signed int32)."""


def _rounded_pattern(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 pattern of the bf16 rounding (to nearest, ties away from zero) of a non-NaN.

    Adding half an ulp to the whole pattern rounds the magnitude (the low 31 bits) up from a
    low half of 0x8000; it never carries into the sign bit below magnitude 0x7FFF8000, and
    every non-NaN magnitude is at most 0x7F800000 (infinity). NaNs are the callers' business.
    """
    return (bits + _HALF_ULP) & _HIGH_HALF


def _bf16_of(rounded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The bf16 of a rounded pattern (an exact cast: its low half is zero); a NaN ``x`` gives a
    NaN (its pattern may have rounded down to an infinity or wrapped around)."""
    return rounded.view(torch.float32).to(torch.bfloat16).masked_fill_(torch.isnan(x),
                                                                        float("nan"))


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16: to nearest, ties away from zero (module docstring)."""
    if x.dtype != torch.float32:
        raise RuntimeError(f"round_to_bf16 takes float32, got {x.dtype}")
    return _bf16_of(_rounded_pattern(x.view(torch.int32)), x)


def split_bf16_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, remainder)``: ``hi = round_to_bf16(x)``, ``remainder = bits(x) - bits(hi)`` (int16)."""
    if x.dtype != torch.float32:
        raise RuntimeError(f"split_bf16_remainder takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    rounded = _rounded_pattern(bits)
    # In [-2^15, 2^15 - 1]: a pattern rounds up only from a low half of at least 2^15. (For a
    # NaN the remainder is arbitrary; added to the NaN hi it still gives a NaN pattern.)
    remainder = (bits - rounded).to(torch.int16)
    return _bf16_of(rounded, x), remainder


def combine_bf16_remainder(hi: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 value whose :func:`split_bf16_remainder` is ``(hi, remainder)``."""
    if hi.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise RuntimeError(
            f"combine_bf16_remainder takes bfloat16 and int16, got {hi.dtype} and {remainder.dtype}"
        )
    # bf16 -> fp32 is exact: it appends 16 zero bits to the pattern.
    return (hi.float().view(torch.int32) + remainder.to(torch.int32)).view(torch.float32)
