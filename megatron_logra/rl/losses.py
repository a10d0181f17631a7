"""Per-token policy losses in Megatron's per-token-loss convention.

Each loss returns the SUM over valid (response-mask) tokens of its per-token loss together with the
number of valid tokens. The trainer adds sums and counts over microbatches and data-parallel ranks
and divides once, so the gradient is that of a token mean over the global batch, whatever the
microbatching. Metrics are returned the same way (detached sums and counts) so they aggregate
exactly; divide by the summed ``num_tokens`` for a mean.

``paper`` (LoGRA, arXiv 2610.06647): REINFORCE with a detached truncated importance weight that
corrects for the rollout engine's numerics (and a stale batch's policy) differing from the
trainer's:

    w_t = min(exp(logp_old_t - logp_rollout_t), cap)                    (detached, cap = 2)
    loss_t = -w_t * A_i * logp_t

``logp_old`` are the trainer's log-probs of the sampled tokens before the update; in synchronous
RL they equal the current ones, so by default ``logp.detach()`` is used. No reference KL. The
weight is ``rl.loss.correction`` (``megatron_logra.rl.off_policy``): the paper's is ``tis``.

``grpo``: PPO-style clipped surrogate and an optional k3 reference-KL penalty:

    r_t = exp(logp_t - logp_old_t)
    loss_t = -w_t * min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i)
             + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

with ``w_t`` the same correction against the rollout's log-probs when one is given, else 1.

Inputs are ``[B, L]`` log-probs of the sampled tokens (fp32 recommended), a ``[B, L]`` response mask
(bool or 0/1) and ``[B]`` advantages. Positions outside the mask may hold anything (padding, -inf):
they are replaced by 0 before any arithmetic, so they contribute neither loss nor NaN gradients.

Shape suffixes: B = responses in the microbatch, L = token positions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_logra.config import CorrectionConfig, GrpoLossConfig
from megatron_logra.rl.off_policy import importance_weights


class TokenLoss(NamedTuple):
    """A microbatch's loss in the per-token convention (unpacks as a 3-tuple)."""

    loss_sum: torch.Tensor
    """Scalar: sum of the per-token loss over valid tokens (carries the autograd graph)."""
    num_tokens: torch.Tensor
    """Scalar int64: number of valid tokens."""
    metrics: dict[str, torch.Tensor]
    """Detached scalar sums / counts over valid tokens."""


class MismatchSums(NamedTuple):
    """Sum and count of ``logp_rollout - logp_train`` over tokens of completed responses."""

    gap_sum: torch.Tensor
    """Scalar float64, detached."""
    num_tokens: torch.Tensor
    """Scalar int64."""


def _check_token_tensor(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but logprobs has {tuple(shape)}; pass one "
            "value per response token, padded the same way"
        )


def _valid_mask(response_mask_BL: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    _check_token_tensor("response_mask", response_mask_BL, shape)
    if response_mask_BL.dtype == torch.bool:
        return response_mask_BL
    if not ((response_mask_BL == 0) | (response_mask_BL == 1)).all():
        raise ValueError("response_mask must be bool or hold only 0 and 1")
    return response_mask_BL != 0


def _check_advantages(advantages_B: torch.Tensor, shape: torch.Size) -> None:
    if advantages_B.shape != shape[:1]:
        raise ValueError(
            f"advantages has shape {tuple(advantages_B.shape)}; it must be [B] = "
            f"[{shape[0]}], one advantage per response"
        )


def _masked(tensor_BL: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
    # torch.where (not multiplication) so that -inf / NaN at padding cannot turn into NaN.
    return torch.where(valid_BL, tensor_BL, 0.0)


def paper_policy_loss(
    logprobs_BL: torch.Tensor,
    rollout_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    response_mask_BL: torch.Tensor,
    *,
    config: CorrectionConfig,
    old_logprobs_BL: torch.Tensor | None = None,
) -> TokenLoss:
    """REINFORCE with a detached truncated importance weight (the ``paper`` preset).

    Args:
        logprobs_BL: the trainer's current log-probs of the sampled tokens (with grad).
        rollout_logprobs_BL: the rollout engine's log-probs of the same tokens.
        advantages_B: one advantage per response.
        response_mask_BL: True at generated tokens that count.
        old_logprobs_BL: the trainer's log-probs before the update; None means the current ones
            (synchronous RL: one update per batch of rollouts).

    ``config``: the correction that makes the weight (``tis``: the paper's truncation).

    Metrics: ``importance_weight_sum`` (after correction), ``truncated_count`` (tokens whose
    weight is not their raw ratio: truncated or masked), ``importance_ratio_sum`` and
    ``importance_ratio_max`` of the raw ratio.
    """
    config.validate()
    shape = logprobs_BL.shape
    if logprobs_BL.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(shape)}; it must be [B, L]")
    _check_token_tensor("rollout_logprobs", rollout_logprobs_BL, shape)
    _check_advantages(advantages_B, shape)
    valid_BL = _valid_mask(response_mask_BL, shape)
    if old_logprobs_BL is None:
        old_logprobs_BL = logprobs_BL
    _check_token_tensor("old_logprobs", old_logprobs_BL, shape)

    logprobs_BL = _masked(logprobs_BL, valid_BL)
    # The weight is a constant of the surrogate: no gradient flows through it.
    weights = importance_weights(old_logprobs_BL, rollout_logprobs_BL, valid_BL, config)
    advantages_B1 = advantages_B.detach().to(logprobs_BL.dtype)[:, None]
    per_token_BL = -(weights.weight_BL * advantages_B1) * logprobs_BL
    loss_sum = _masked(per_token_BL, valid_BL).sum()
    return TokenLoss(loss_sum, valid_BL.sum(), weights.metrics)


def grpo_policy_loss(
    logprobs_BL: torch.Tensor,
    old_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    response_mask_BL: torch.Tensor,
    *,
    config: GrpoLossConfig,
    reference_logprobs_BL: torch.Tensor | None = None,
    rollout_logprobs_BL: torch.Tensor | None = None,
    correction: CorrectionConfig | None = None,
) -> TokenLoss:
    """PPO-clipped surrogate with an optional k3 reference KL (the ``grpo`` preset).

    Args:
        logprobs_BL: the trainer's current log-probs of the sampled tokens (with grad).
        old_logprobs_BL: the log-probs the ratio is taken against (detached): the trainer's own
            before the update (``logprobs.detach()`` for a single update per batch), or the rollout
            engine's, which lets the clip also bound the engine/trainer mismatch.
        advantages_B: one advantage per response.
        response_mask_BL: True at generated tokens that count.
        reference_logprobs_BL: the frozen reference policy's log-probs; required when
            ``config.kl_beta > 0``.
        rollout_logprobs_BL, correction: the engine's log-probs and the correction that
            weighs each token's surrogate against them (``old_logprobs`` over them); None: no
            correction.

    Metrics: ``ratio_sum``, ``clipped_count`` (tokens whose clipped term was selected and differs
    from the unclipped one, i.e. that get no gradient from the surrogate) and, with a reference,
    ``kl_sum`` (the k3 estimate without beta).
    """
    config.validate()
    shape = logprobs_BL.shape
    if logprobs_BL.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(shape)}; it must be [B, L]")
    _check_token_tensor("old_logprobs", old_logprobs_BL, shape)
    _check_advantages(advantages_B, shape)
    valid_BL = _valid_mask(response_mask_BL, shape)
    if config.kl_beta > 0 and reference_logprobs_BL is None:
        raise ValueError(
            f"kl_beta={config.kl_beta} needs reference_logprobs; pass the reference policy's "
            "log-probs or set kl_beta=0"
        )

    logprobs_BL = _masked(logprobs_BL, valid_BL)
    old_BL = _masked(old_logprobs_BL.detach(), valid_BL)
    advantages_B1 = advantages_B.detach().to(logprobs_BL.dtype)[:, None]
    ratio_BL = (logprobs_BL - old_BL).exp()
    clipped_ratio_BL = ratio_BL.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    unclipped_BL = ratio_BL * advantages_B1
    clipped_BL = clipped_ratio_BL * advantages_B1
    per_token_BL = -torch.minimum(unclipped_BL, clipped_BL)
    weight_metrics = {}
    if correction is not None:
        if rollout_logprobs_BL is None:
            raise ValueError("correction needs rollout_logprobs: the engine's log-probs")
        _check_token_tensor("rollout_logprobs", rollout_logprobs_BL, shape)
        weights = importance_weights(old_BL, rollout_logprobs_BL, valid_BL, correction)
        per_token_BL = weights.weight_BL * per_token_BL
        weight_metrics = weights.metrics

    valid_float_BL = valid_BL.to(ratio_BL.dtype)
    metrics = {
        "ratio_sum": (ratio_BL * valid_float_BL).sum().detach(),
        "clipped_count": ((clipped_BL < unclipped_BL) & valid_BL).sum(),
        **weight_metrics,
    }
    if reference_logprobs_BL is not None:
        _check_token_tensor("reference_logprobs", reference_logprobs_BL, shape)
        log_ref_ratio_BL = _masked(reference_logprobs_BL.detach(), valid_BL) - logprobs_BL
        kl_BL = log_ref_ratio_BL.exp() - log_ref_ratio_BL - 1.0
        if config.kl_beta > 0:
            per_token_BL = per_token_BL + config.kl_beta * kl_BL
        metrics["kl_sum"] = (kl_BL * valid_float_BL).sum().detach()
    loss_sum = _masked(per_token_BL, valid_BL).sum()
    return TokenLoss(loss_sum, valid_BL.sum(), metrics)


def rollout_mismatch_sums(
    train_logprobs_BL: torch.Tensor,
    rollout_logprobs_BL: torch.Tensor,
    response_mask_BL: torch.Tensor,
    completed_B: torch.Tensor,
) -> MismatchSums:
    """Sum and count of ``logp_rollout - logp_train`` over valid tokens of completed responses.

    The mean (sum / count after all-reducing both) estimates KL(pi_rollout || pi_train) per token,
    the mismatch the KL controller subtracts from its budget. Truncated responses (no EOS) are
    left out: a response cut at the length limit is not a sample of the policy's own stopping.

    Args:
        completed_B: bool ``[B]``, True for responses that ended with EOS.
    """
    shape = train_logprobs_BL.shape
    if train_logprobs_BL.dim() != 2:
        raise ValueError(f"train_logprobs has shape {tuple(shape)}; it must be [B, L]")
    _check_token_tensor("rollout_logprobs", rollout_logprobs_BL, shape)
    valid_BL = _valid_mask(response_mask_BL, shape)
    if completed_B.shape != shape[:1] or completed_B.dtype != torch.bool:
        raise ValueError(
            f"completed has shape {tuple(completed_B.shape)} and dtype {completed_B.dtype}; it "
            f"must be bool [{shape[0]}], True where the response ended with EOS"
        )
    counted_BL = valid_BL & completed_B[:, None]
    gap_BL = rollout_logprobs_BL.detach().double() - train_logprobs_BL.detach().double()
    gap_sum = _masked(gap_BL, counted_BL).sum()
    return MismatchSums(gap_sum, counted_BL.sum())


def rollout_gap_max(
    train_logprobs_BL: torch.Tensor,
    rollout_logprobs_BL: torch.Tensor,
    response_mask_BL: torch.Tensor,
) -> torch.Tensor:
    """The largest ``|logp_rollout - logp_train|`` over every valid token (float64, 0 with
    none): the per-token agreement of the sampler with the trainer, which a mean gap hides
    (opposite errors cancel in it)."""
    shape = train_logprobs_BL.shape
    _check_token_tensor("rollout_logprobs", rollout_logprobs_BL, shape)
    valid_BL = _valid_mask(response_mask_BL, shape)
    gap_BL = (rollout_logprobs_BL.detach().double() - train_logprobs_BL.detach().double()).abs()
    return _masked(gap_BL, valid_BL).max()
