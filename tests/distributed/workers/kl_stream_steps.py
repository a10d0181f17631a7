"""The streamed KL probe against the whole-batch probe it replaced, over controlled training steps
(run inside ``logit_jvp_worker``'s two jobs, which already hold a 1- and a 2-process world).

Paper mode under predicted-KL step control on the tiny GPT (fp32), a few optimizer steps on a
fixed global batch of ragged sequences (a masked prompt, counted response positions, uncounted
padding after them). The step control streams its probe (one unpadded piece per response, the
output layer chunk by chunk, the realised KL from the kept final hidden states); beside it, at
every step, the worker computes what the previous implementation computed on the same proposal:
the whole padded probe rows through ``logit_jvp`` (one pass, MLPs unchunked) (the model's own output layer, ``[b, s, V]``
logits and tangent), the vocab-parallel predicted KL over the mask, alpha from the controller's
arithmetic, and after the update the realised KL from the kept whole pre-update logits and a
plain forward (``probe_logits``).

:func:`controlled_steps` runs one layout (TP=1 in the 1-process job; TP=2 with sequence
parallelism, PP=2, DP=2 and an MoE model with EP=2 in the 2-process one, :data:`LAYOUTS`) and
returns ``{"steps": [{alpha, alpha_whole, predicted, predicted_whole, realised,
realised_whole}], "piece_lengths": [...], "real_lengths": [...]}``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import switch_layout

from megatron_logra.config import load_config
from megatron_logra.controller import step_scale
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.kl import exact_kl_vocab_parallel, predicted_kl_vocab_parallel
from megatron_logra.mcore.kl_probe import stream
from megatron_logra.mcore.kl_probe.logit_jvp import LowRankDirection, logit_jvp, probe_logits
from megatron_logra.mcore.models import sdpa_forward_ad
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import train_step
from megatron_logra.probe_batch import supervised_probe_batch
from megatron_logra.probe_selection import probe_indices
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt

VOCAB = 100  # padded to 128 by the model: the padding columns are masked out of every softmax
SEQ = 32
STEPS = 3
GLOBAL_BATCH = 4
MICRO_BATCH = 2
# Per sequence of the global batch: its real tokens and its prompt (the first counted
# position is the prompt's last token, whose next token is the first response token).
REAL_LENGTHS = (32, 25, 19, 28)
PROMPT_LENGTHS = (5, 9, 3, 7)
# Sequences 0, 1 and 2 of the global batch (evenly spaced: 4 x i // 3): 2 + 1 over two DP (or
# EP) ranks.
PROBE_RESPONSES = 3
BASE = [
    "parallel.device=cpu", *tiny_gpt(seq_length=SEQ), *SWIGLU_RMSNORM_NO_BIAS,
    f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={GLOBAL_BATCH}",
    f"train.steps={STEPS}", "optimizer.name=logra", "logra.sketch_rank=8", "logra.mode=paper",
    # The proposal is larger than the budget: alpha < 1, the prediction at work.
    "logra.update_ratio=1e-1", "logra.update_factor_dtype=fp32",
    "logra.kl_control.enabled=true", "logra.kl_control.kl_budget=2e-4",
    "logra.kl_control.kl_budget_final=2e-4",
    f"logra.kl_control.probe_responses={PROBE_RESPONSES}",
]
# Budgets small enough that at these sizes every piece's MLP runs in several chunks of rows (10
# local rows at ffn 128) and the attention tangent rule in several blocks (4 heads x 8 rows of
# 32 keys), as they do at RL lengths with the real budgets.
MLP_CHUNK_ELEMENTS = 10 * 128
ATTENTION_BLOCK_ELEMENTS = 4 * 8 * 32
MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32", "model.moe_router_topk=2",
       "model.moe_token_dispatcher=alltoall"]
LAYOUTS: dict[str, list[str]] = {
    "tp2_sp": ["parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel.tp=1", "parallel.pp=2"],
    "dp2": ["parallel.tp=1"],
    "ep2": ["parallel.tp=1", "parallel.ep=2", *MOE],
}


def config(overrides: list[str], world: int):
    return load_config(None, [*BASE, *overrides]).resolved(world)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B, S + 1]`` and the loss mask ``[B, S]`` of the fixed global batch."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row, (real, prompt) in enumerate(zip(REAL_LENGTHS, PROMPT_LENGTHS, strict=True)):
        tokens[row, real:] = 0
        mask[row, prompt - 1:real - 1] = 1.0
    return tokens, mask


def microbatches(groups) -> list[Microbatch]:
    tokens, mask = global_batch()
    per_rank = GLOBAL_BATCH // groups.dp_size
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    tokens, mask = tokens[rows], mask[rows]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
    return [Microbatch(tokens=tokens[i:i + MICRO_BATCH, :-1].contiguous(),
                       labels=tokens[i:i + MICRO_BATCH, 1:].contiguous(),
                       loss_mask=mask[i:i + MICRO_BATCH].contiguous(), position_ids=positions)
            for i in range(0, per_rank, MICRO_BATCH)]


def probe_rows(groups) -> list[int]:
    """This rank's probe rows (indices into its share), as the step control selects them."""
    per_rank = GLOBAL_BATCH // groups.dp_size
    share = range(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    return [i - share.start for i in probe_indices(GLOBAL_BATCH, PROBE_RESPONSES) if i in share]


def whole_rows(batch: list[Microbatch], groups) -> tuple[torch.Tensor, ...]:
    """The previous implementation's probe: this rank's probe rows whole (padded), with their
    mask."""
    rows = probe_rows(groups)
    tokens = torch.cat([b.tokens for b in batch])[rows]
    positions = torch.cat([b.position_ids for b in batch])[rows]
    mask = torch.cat([b.loss_mask for b in batch])[rows] > 0
    return tokens, positions, mask


def whole_mean(local, groups) -> float:
    """The previous implementation's reduction: TP rank 0 of the last stage contributes."""
    total = torch.zeros(2, dtype=torch.float64)
    if local is not None and groups.is_last_stage() and groups.tp_rank == 0:
        total[0], total[1] = local.total, local.count
    dist.all_reduce(total)
    return float(total[0] / total[1])


class WholeBatchProbe:
    """The step scale the optimizer calls: the whole-batch prediction on the same proposal,
    then the streamed step control's decision (which sizes the update)."""

    def __init__(self, control, groups) -> None:
        self.control, self.groups = control, groups
        self.rows: tuple[torch.Tensor, ...] = ()
        self.logits: torch.Tensor | None = None
        self.predicted = self.alpha = float("nan")

    def __call__(self, proposal) -> float:
        control, groups = self.control, self.groups
        tokens, positions, mask = self.rows
        directions = {key: LowRankDirection(left, right)
                      for key, (left, right) in proposal.directions.items()}
        local, self.logits = None, None
        if tokens.shape[0] > 0:
            result = logit_jvp(control.model_chunks, tokens, positions, targets=control.targets,
                               directions=directions, pipeline=control.pipeline)
            if result is not None:
                local = predicted_kl_vocab_parallel(
                    result.logits, result.tangent, temperature=control.kl.temperature,
                    tp_group=groups.tp, mask=mask, vocab_size=VOCAB)
                self.logits = result.logits
        self.predicted = whole_mean(local, groups)
        alpha = control(proposal)
        decision = control.decision
        self.alpha = step_scale(self.predicted, decision.kl_budget_effective,
                                control.controller.settings.alpha_max)
        return alpha

    def realised(self) -> float:
        tokens, positions, mask = self.rows
        local = None
        if tokens.shape[0] > 0:
            after = probe_logits(self.control.model_chunks, tokens, positions,
                                 pipeline=self.control.pipeline)
            if after is not None:
                local = exact_kl_vocab_parallel(
                    self.logits, after, temperature=self.control.kl.temperature,
                    tp_group=self.groups.tp, mask=mask, vocab_size=VOCAB)
        self.logits = None
        return whole_mean(local, self.groups)

    def state_dict(self) -> dict[str, Any]:
        return self.control.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.control.load_state_dict(state)


def controlled_steps(cfg, groups) -> dict[str, Any]:
    stream.MLP_CHUNK_ELEMENTS = MLP_CHUNK_ELEMENTS
    sdpa_forward_ad.BLOCK_ELEMENTS = ATTENTION_BLOCK_ELEMENTS
    torch.manual_seed(1234)
    chunks = build_model_chunks(cfg, groups, vocab_size=VOCAB)
    setup = setup_training(cfg, chunks, groups, kl_vocab_size=VOCAB)
    control = setup.kl_control
    whole = WholeBatchProbe(control, groups)
    setup.logra.step_scale = whole
    batch = microbatches(groups)
    steps = []
    for _ in range(STEPS):
        control.set_batch(supervised_probe_batch(batch, cfg.logra.kl_control,
                                                 dp_rank=groups.dp_rank, dp_size=groups.dp_size))
        whole.rows = whole_rows(batch, groups)
        train_step(setup, batch, groups=groups, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        steps.append({
            "alpha": control.decision.alpha, "alpha_whole": whole.alpha,
            "predicted": control.decision.kl_predicted, "predicted_whole": whole.predicted,
            "realised": control.realised(), "realised_whole": whole.realised(),
        })
    # Each global row's piece length; an uncounted padding piece (expert parallelism) after
    # the probe rows of the rank that runs it.
    lengths = torch.zeros(GLOBAL_BATCH, dtype=torch.int64)
    per_rank = GLOBAL_BATCH // groups.dp_size
    rows = probe_rows(groups)
    if groups.tp_rank == 0 and groups.pp_rank == 0:
        for index, piece in enumerate(control.pieces):
            row = rows[index] if index < len(rows) else rows[-1] + index - len(rows) + 1
            lengths[groups.dp_rank * per_rank + row] = piece.length
    dist.all_reduce(lengths)
    return {"steps": steps, "piece_lengths": lengths.tolist(),
            "real_lengths": [real - 1 for real in REAL_LENGTHS]}


def tp1_steps() -> dict[str, Any]:
    """TP=1 in a 1-process world."""
    cfg = config(["parallel.tp=1"], 1)
    return {"tp1": controlled_steps(cfg, switch_layout(cfg))}


def layout_steps() -> dict[str, Any]:
    """Every 2-process layout of :data:`LAYOUTS`, one after another."""
    report = {}
    for name, overrides in LAYOUTS.items():
        cfg = config(overrides, 2)
        report[name] = controlled_steps(cfg, switch_layout(cfg))
    return report
