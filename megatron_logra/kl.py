"""Per-token KL divergences of a softmax policy: the Fisher prediction and the exact value.

The predicted-KL step controller sizes an update by how far it moves the sampling distribution.
With logits ``z`` at one position, sampling temperature ``T``, ``p = softmax(z / T)`` and the
first-order logit change ``dz`` of an update, the second-order expansion of
``KL(pi_old || pi_new)`` is the Fisher quadratic form

    m = 1/2 * Var_{v ~ p}(dz_v / T) = 1/2 * dz^T (diag(p) - p p^T) dz / T^2,

which scales with the square of the step. :func:`predicted_kl` computes it;
:func:`exact_kl` computes ``KL(softmax(z_old / T) || softmax(z_new / T))`` between two logit
tensors, for measuring the KL an update actually realised.

Both come in a full-vocabulary form and a vocab-parallel form. The vocab-parallel form takes this
rank's vocabulary shard (what Megatron's output layer produces with ``parallel_output=True``) and
the tensor-parallel group, and computes the same numbers with a few all-reduces of per-position
scalars; the vocabulary is never gathered.

Everything is computed in float64 (a KL of 1e-5 from logits of size ~10 needs the precision), in
chunks of positions so the float64 temporaries stay at ``chunk_positions x V`` elements. Each
function returns a :class:`TokenSum` (sum over the selected positions, and their count) so that
callers can reduce over data parallelism before dividing.

Shape suffixes: N = positions, V = vocabulary (or this rank's shard of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Positions per float64 chunk: with a 152k vocabulary one chunk's temporaries are ~80 MB each.
DEFAULT_CHUNK_POSITIONS = 64


@dataclass(frozen=True)
class TokenSum:
    """A sum of per-token values and the number of tokens, both float64 scalars.

    Attributes:
        total: sum of the per-token values over the selected positions.
        count: number of selected positions (exact in float64 up to 2**53).
    """

    total: torch.Tensor
    count: torch.Tensor

    def all_reduced(self, group: dist.ProcessGroup | None) -> TokenSum:
        """Sums over ``group`` (e.g. data parallelism) in one collective."""
        both = torch.stack([self.total, self.count])
        dist.all_reduce(both, group=group)
        return TokenSum(total=both[0], count=both[1])

    def mean(self) -> float:
        """``total / count``; RuntimeError when no position was selected."""
        count = float(self.count)
        if count <= 0:
            raise RuntimeError("a token mean over zero positions is undefined (empty probe set)")
        return float(self.total) / count


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature={temperature!r} must be a finite positive number (the rollout "
            "sampling temperature)"
        )


def _positions(
    first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor | None, names: tuple[str, str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten ``[..., V]`` tensors to ``[N_all, V]`` and return the selected row indices."""
    if first.shape != second.shape:
        raise ValueError(
            f"{names[0]} {tuple(first.shape)} and {names[1]} {tuple(second.shape)} must have the "
            "same shape [..., V]"
        )
    if first.dim() < 1 or first.shape[-1] == 0:
        raise ValueError(f"{names[0]} must have a non-empty last (vocabulary) dimension")
    vocab = first.shape[-1]
    first_NV, second_NV = first.reshape(-1, vocab), second.reshape(-1, vocab)
    if mask is None:
        rows_N = torch.arange(first_NV.shape[0], device=first.device)
    else:
        if mask.dtype != torch.bool or mask.shape != first.shape[:-1]:
            raise ValueError(
                f"mask must be a bool tensor of shape {tuple(first.shape[:-1])} (one entry per "
                f"position), got {mask.dtype} {tuple(mask.shape)}"
            )
        rows_N = mask.reshape(-1).nonzero().squeeze(1)
    return first_NV, second_NV, rows_N


def _valid_columns(
    width: int, vocab_start: int, vocab_size: int | None, device: torch.device
) -> torch.Tensor | None:
    """Bool ``[width]`` marking real (non-padding) entries of a vocabulary shard, or None."""
    if vocab_size is None:
        return None
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive (the unpadded vocabulary)")
    columns = torch.arange(vocab_start, vocab_start + width, device=device)
    return columns < vocab_size


def _chunked_sum(
    first_NV: torch.Tensor,
    second_NV: torch.Tensor,
    rows_N: torch.Tensor,
    chunk_positions: int,
    per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> TokenSum:
    if chunk_positions <= 0:
        raise ValueError(f"chunk_positions={chunk_positions} must be positive")
    total = torch.zeros((), dtype=torch.float64, device=first_NV.device)
    for start in range(0, rows_N.shape[0], chunk_positions):
        rows = rows_N[start : start + chunk_positions]
        total += per_token(
            first_NV.index_select(0, rows).double(), second_NV.index_select(0, rows).double()
        ).sum()
    count = torch.tensor(float(rows_N.shape[0]), dtype=torch.float64, device=first_NV.device)
    return TokenSum(total=total, count=count)


# ----------------------------------------------------------------------------- predicted KL


def _mask_padding(
    scaled_NV: torch.Tensor, other_NV: torch.Tensor, valid_V: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding entries get probability zero (logit -inf) and a zero companion value."""
    if valid_V is None:
        return scaled_NV, other_NV
    return (
        scaled_NV.masked_fill(~valid_V, -math.inf),
        other_NV.masked_fill(~valid_V, 0.0),
    )


def predicted_kl(
    logits: torch.Tensor,
    tangent: torch.Tensor,
    *,
    temperature: float,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunk_positions: int = DEFAULT_CHUNK_POSITIONS,
) -> TokenSum:
    """Sum over positions of ``m_t = 1/2 Var_{v~p}(dz_v / T)``, ``p = softmax(z / T)``.

    Args:
        logits: ``[..., V]`` logits ``z`` over the whole vocabulary.
        tangent: ``[..., V]`` first-order logit change ``dz`` along the update.
        temperature: the sampling temperature T.
        mask: optional bool ``[...]``: the positions to include (default all).
        vocab_size: optional unpadded vocabulary size; entries at and beyond it are padding and
            get probability zero (default: every entry is a real token).
        chunk_positions: positions per float64 chunk.
    """
    _check_temperature(temperature)
    z_NV, dz_NV, rows_N = _positions(logits, tangent, mask, ("logits", "tangent"))
    valid_V = _valid_columns(z_NV.shape[1], 0, vocab_size, z_NV.device)

    def per_token(z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        a, u = _mask_padding(z / temperature, dz / temperature, valid_V)
        p = torch.softmax(a, dim=-1)
        mean = (p * u).sum(dim=-1, keepdim=True)
        # Centred before squaring: E[u^2] - E[u]^2 would cancel when |E[u]| >> std(u).
        return 0.5 * (p * (u - mean).square()).sum(dim=-1)

    return _chunked_sum(z_NV, dz_NV, rows_N, chunk_positions, per_token)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup,
                op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In place over ``group``; nothing to do (and no collective's latency) for one rank."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _check_same_positions(rows: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of the group must select the same number of positions, or the per-chunk
    collectives would pair up different chunks (or hang)."""
    if dist.get_world_size(group) == 1:
        return
    bounds = torch.tensor([rows, -rows], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    if int(bounds[0]) != -int(bounds[1]):
        raise RuntimeError(
            f"vocab-parallel KL: this rank selected {rows} positions but others selected between "
            f"{-int(bounds[1])} and {int(bounds[0])}; every tensor-parallel rank must pass the "
            "same positions and mask"
        )


def _vocab_start(width: int, tp_group: dist.ProcessGroup) -> int:
    # Megatron's vocab-parallel layout: rank r owns [r * width, (r + 1) * width).
    return dist.get_rank(tp_group) * width


def predicted_kl_vocab_parallel(
    logits_shard: torch.Tensor,
    tangent_shard: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunk_positions: int = DEFAULT_CHUNK_POSITIONS,
) -> TokenSum:
    """:func:`predicted_kl` from this rank's vocabulary shard, without gathering the vocabulary.

    Per chunk of positions: an all-reduce (max) of the logit maxima, one (sum) of the
    partition function and ``sum_v e^{z_v} u_v`` together, and one (sum) of the centred second
    moment. Every rank of ``tp_group`` must call it with the same positions and mask; each
    returns the same full-vocabulary result (reduce it over data parallelism only).
    """
    _check_temperature(temperature)
    z_NV, dz_NV, rows_N = _positions(logits_shard, tangent_shard, mask, ("logits", "tangent"))
    _check_same_positions(rows_N.shape[0], tp_group, z_NV.device)
    width = z_NV.shape[1]
    valid_V = _valid_columns(width, _vocab_start(width, tp_group), vocab_size, z_NV.device)

    def per_token(z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        a, u = _mask_padding(z / temperature, dz / temperature, valid_V)
        a_max = a.max(dim=-1).values
        _all_reduce(a_max, tp_group, dist.ReduceOp.MAX)
        e = torch.exp(a - a_max[:, None])
        moments = torch.stack([e.sum(dim=-1), (e * u).sum(dim=-1)])
        _all_reduce(moments, tp_group)
        mean = moments[1] / moments[0]
        centred = (e * (u - mean[:, None]).square()).sum(dim=-1)
        _all_reduce(centred, tp_group)
        return 0.5 * centred / moments[0]

    return _chunked_sum(z_NV, dz_NV, rows_N, chunk_positions, per_token)


# ----------------------------------------------------------------------------- exact KL


def exact_kl(
    logits_old: torch.Tensor,
    logits_new: torch.Tensor,
    *,
    temperature: float,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunk_positions: int = DEFAULT_CHUNK_POSITIONS,
) -> TokenSum:
    """Sum over positions of ``KL(softmax(z_old / T) || softmax(z_new / T))``.

    With ``a = z_old / T``, ``b = z_new / T`` and ``d = b - a`` the per-token value is
    ``logsumexp(b) - logsumexp(a) - sum_v p_v d_v`` (p = softmax(a)); both logsumexps are
    max-shifted, so any logit range is safe. Arguments as for :func:`predicted_kl`.
    """
    _check_temperature(temperature)
    old_NV, new_NV, rows_N = _positions(logits_old, logits_new, mask, ("logits_old", "logits_new"))
    valid_V = _valid_columns(old_NV.shape[1], 0, vocab_size, old_NV.device)

    def per_token(z_old: torch.Tensor, z_new: torch.Tensor) -> torch.Tensor:
        a, b = z_old / temperature, z_new / temperature
        d = b - a
        a, d = _mask_padding(a, d, valid_V)
        b, _ = _mask_padding(b, d, valid_V)
        lse_a = torch.logsumexp(a, dim=-1)
        p = torch.exp(a - lse_a[:, None])
        return torch.logsumexp(b, dim=-1) - lse_a - (p * d).sum(dim=-1)

    return _chunked_sum(old_NV, new_NV, rows_N, chunk_positions, per_token)


def exact_kl_vocab_parallel(
    logits_old_shard: torch.Tensor,
    logits_new_shard: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunk_positions: int = DEFAULT_CHUNK_POSITIONS,
) -> TokenSum:
    """:func:`exact_kl` from this rank's vocabulary shards, without gathering the vocabulary.

    Per chunk of positions: one all-reduce (max) of both logit maxima and one (sum) of both
    partition functions and ``sum_v e^{a_v} d_v``. Same calling contract as
    :func:`predicted_kl_vocab_parallel`.
    """
    _check_temperature(temperature)
    old_NV, new_NV, rows_N = _positions(
        logits_old_shard, logits_new_shard, mask, ("logits_old", "logits_new")
    )
    _check_same_positions(rows_N.shape[0], tp_group, old_NV.device)
    width = old_NV.shape[1]
    valid_V = _valid_columns(width, _vocab_start(width, tp_group), vocab_size, old_NV.device)

    def per_token(z_old: torch.Tensor, z_new: torch.Tensor) -> torch.Tensor:
        a, b = z_old / temperature, z_new / temperature
        d = b - a
        a, d = _mask_padding(a, d, valid_V)
        b, _ = _mask_padding(b, d, valid_V)
        maxima = torch.stack([a.max(dim=-1).values, b.max(dim=-1).values])
        _all_reduce(maxima, tp_group, dist.ReduceOp.MAX)
        e_a = torch.exp(a - maxima[0][:, None])
        sums = torch.stack(
            [e_a.sum(dim=-1), torch.exp(b - maxima[1][:, None]).sum(dim=-1), (e_a * d).sum(dim=-1)]
        )
        _all_reduce(sums, tp_group)
        lse_a = maxima[0] + torch.log(sums[0])
        lse_b = maxima[1] + torch.log(sums[1])
        return lse_b - lse_a - sums[2] / sums[0]

    return _chunked_sum(old_NV, new_NV, rows_N, chunk_positions, per_token)
