"""Importance weights of sampled tokens against the rollout engine's sampling log-probs.

A batch is sampled by the engine's policy ``pi_rollout``; the loss is taken for the trainer's
policy before this batch's first update, ``pi_old``. They differ by numerics (another
implementation of the same function) and, when the batch is k policy versions stale
(``rollout.max_staleness``), by the k updates made since the engine held that version. Per token
``rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(logp_old_t - logp_rollout_t)``, and the loss weighs
each token's term by a detached ``w_t`` (``rl.loss.correction.name``):

* ``tis``: ``w_t = min(rho_t, C)`` -- truncated importance sampling, the paper's weight (C = 2);
* ``icepop``: ``w_t = rho_t`` inside ``[low, high]``, else 0 (the token gets no gradient);
* ``seq_mask_tis``: ``w_t = min(rho_t, C)``, and 0 for every token of a response whose
  geometric-mean ratio ``exp(mean_t log rho_t)`` leaves ``[low, high]``;
* ``none``: ``w_t = 1``.

Sums for the step's metrics (over valid tokens, detached): the weights, the raw ratios, their
maximum, and the tokens whose weight differs from their raw ratio (truncated or masked).

Shape suffixes: B = responses, L = token positions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_logra.config.off_policy import CorrectionConfig

# exp() of a larger fp32 log-ratio overflows to inf (at 88.7); a ratio that large is masked or
# truncated by every correction, and its metric stays finite.
_MAX_LOG_RATIO = 80.0


class ImportanceWeights(NamedTuple):
    weight_BL: torch.Tensor
    """Detached weights in the log-probs' dtype, 0 outside the valid tokens."""
    metrics: dict[str, torch.Tensor]
    """``importance_weight_sum``, ``importance_ratio_sum``, ``importance_ratio_max`` (0 when
    no token is valid) and ``truncated_count``, over valid tokens."""


def importance_weights(old_logprobs_BL: torch.Tensor, rollout_logprobs_BL: torch.Tensor,
                       valid_BL: torch.Tensor, config: CorrectionConfig) -> ImportanceWeights:
    """The corrected per-token weights ``w`` of ``rho = exp(old - rollout)`` (module docstring).

    Args:
        old_logprobs_BL: the trainer's log-probs of the sampled tokens before this batch's
            first update.
        rollout_logprobs_BL: the engine's log-probs of the same tokens (``pi_rollout``).
        valid_BL: bool, True at tokens that count; anything may sit elsewhere.
    """
    name = config.name
    if name == "auto":
        raise RuntimeError("rl.loss.correction.name=auto must be resolved (Config.resolved for "
                           "the rl command) before a loss uses it")
    # In the log-probs' dtype (the paper's weight as it always was); the sums in float64.
    log_ratio_BL = torch.where(valid_BL, old_logprobs_BL.detach() - rollout_logprobs_BL.detach(),
                               0.0)
    ratio_BL = log_ratio_BL.clamp(max=_MAX_LOG_RATIO).exp()
    if name == "tis":
        weight_BL = ratio_BL.clamp(max=config.tis_cap)
        changed_BL = ratio_BL > config.tis_cap
    elif name == "icepop":
        inside_BL = (ratio_BL >= config.mask_low) & (ratio_BL <= config.mask_high)
        weight_BL = torch.where(inside_BL, ratio_BL, 0.0)
        changed_BL = ~inside_BL
    elif name == "seq_mask_tis":
        counts_B = valid_BL.sum(dim=1).clamp(min=1)
        geometric_B = (log_ratio_BL.sum(dim=1) / counts_B).exp()
        kept_B = (geometric_B >= config.mask_low) & (geometric_B <= config.mask_high)
        weight_BL = torch.where(kept_B[:, None], ratio_BL.clamp(max=config.tis_cap), 0.0)
        changed_BL = ~kept_B[:, None] | (ratio_BL > config.tis_cap)
    elif name == "none":
        weight_BL = torch.ones_like(ratio_BL)
        changed_BL = torch.zeros_like(valid_BL)
    else:
        raise ValueError(f"rl.loss.correction.name={name!r} is not one of tis, icepop, "
                         "seq_mask_tis, none")
    weight_BL = torch.where(valid_BL, weight_BL, 0.0)
    valid_ratio_BL = torch.where(valid_BL, ratio_BL, 0.0)
    metrics = {
        "importance_weight_sum": weight_BL.double().sum(),
        "importance_ratio_sum": valid_ratio_BL.double().sum(),
        "importance_ratio_max": (valid_ratio_BL.amax().double() if valid_ratio_BL.numel()
                                 else torch.zeros((), dtype=torch.float64)),
        "truncated_count": (changed_BL & valid_BL).sum(),
    }
    return ImportanceWeights(weight_BL, metrics)
