"""LoGRA on a mixture-of-experts GPT: layout invariance with expert parallelism (issue 16 item 3).

The tiny GPT with one MoE and one dense decoder layer (``model.moe_layer_freq=2``: layer 0 has
Megatron's MoE layer with 4 routed experts of width 32, top-2, dropless, no auxiliary loss, and a
shared expert of width 32 every token passes; layer 1 keeps the dense MLP; swiglu, RMSNorm, no
biases), trained through the real CLI for a few LoGRA steps (library mode: RowAdam over
per-expert sketches, clipping, native Adam for the router, norms and embeddings). Every
expert's linears are targets, each with its own projection keyed by the expert's global index;
the shared expert's and the dense layer's are ordinary dense targets. Every comparison below
covers every tensor, so the dense layer and the shared expert are held to the same bounds as
the routed experts. A layout must not change the run beyond fp32 reduction-order noise:

* EP=2 with the all-to-all dispatcher == EP=1 (each rank holds 2 of the 4 experts; expert
  sketches are summed over the expert-data-parallel group, which is one rank here, and dense
  sketches over DP=2);
* TP=2 with SP and the all-gather dispatcher (Megatron requires SP for MoE under TP; the
  experts are split over expert TP=2, tokens gathered over TP x EP) == TP=1;
* PP=2 x EP=2 (4 ranks: the MoE layer on stage 0, the dense one on stage 1, so one stage has no
  experts at all and still joins the model-wide statistics over expert TP x EP x PP) == EP=1;
  the same parameter names (a stage that built the wrong layer kinds would fail here).

EP=2 x all-gather is not run as well: the two dispatchers are each exercised once.
A job's cost is its start (model build, process groups, checkpoint and weight files: 2-5 s
measured on the 2-core machine at a load of 3-5), not its steps (~0.07 s each at this size), so
the suite saves jobs, not steps: the EP=1 run is the reference of every comparison, and the resume forks the EP=2 run's
checkpoint instead of running its first part again.

The identity limit on the MoE model: LoGRA with A = I, the sgd direction and Megatron's SGD for
the rest reproduces ``optimizer.name=sgd`` at EP=2 (losses, gradient norms with clipping binding,
weight decay, weights) -- so per-expert sketches carry exactly the scaling Megatron gives the
experts' dense gradients (reduced over the expert-data-parallel group) -- except, by design, for
the experts that received no token in a step, which Megatron's SGD decays and LoGRA leaves alone.

Resharded resume: the EP=2 run's checkpoint after step 2, resumed at EP=1 for the last step ==
the uninterrupted EP=1 run (the model's experts through Megatron's global-expert sharded state, the
experts' row moments keyed by their global layer keys, one replica per expert-data-parallel
group).

Paper mode under the predicted-KL controller: EP=2 and TP=2 == EP=1 (alpha, predicted and
realised KL, losses, weights), the realised KL within the prediction's second-order bound; one
paper step with 33 of 64 experts idle leaves them bit for bit unchanged and sizes the moved
targets by the joint update ratio (docs/moe.md has the definition).

bf16 parameters with exact fp32 masters (paper mode, KL control): the experts' masters sharded
over the expert-data-parallel group; EP=2 == EP=1, both against fp32 within the bf16 bounds, and
resume with another master store bit for bit.

Both dispatchers run on CPU over gloo (the all-to-all needs the split-size fix of
``megatron_logra.mcore.compat.moe_fixes``). The reference itself must move every expert.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns, run_differences
from tests.layouts import (
    BF16_VS_FP32_LOSS_REL_TOL,
    BF16_VS_FP32_WEIGHT_NORM_REL_TOL,
    KL_CONTROL_LAYOUT_ALPHA_REL_TOL,
    KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL,
    KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL,
    LOGRA_IDENTITY,
    LOGRA_LAYOUT_LOSS_REL_TOL,
    RESHARD_LOSS_REL_TOL,
    RESHARD_WEIGHT_REL_TOL,
    SGD_PARITY_CLIP,
    SGD_PARITY_WEIGHT_REL_TOL,
    max_entry_rel_err,
    norm_rel_err,
    sgd_parity_weights,
)
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, TINY_GPT, tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 3
NUM_EXPERTS = 4
# Layer 0 is MoE, layer 1 dense (every MOE_LAYER_FREQ-th layer is MoE).
MOE_LAYER_FREQ = 2
MOE_LAYERS = (0,)
MOE = [f"model.num_moe_experts={NUM_EXPERTS}", "model.moe_ffn_hidden_size=32",
       "model.moe_router_topk=2", f"model.moe_layer_freq={MOE_LAYER_FREQ}",
       "model.moe_shared_expert_ffn_hidden_size=32"]
RESUME_AFTER = 2
BASE = [
    "parallel.device=cpu", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS, *MOE,
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=4",
    "optimizer.name=logra", "logra.sketch_rank=8", "optimizer.lr=0.01",
    "optimizer.lr_warmup_steps=0", "optimizer.clip_grad=1.0", "run.save_full_weights=true",
]
# (processes, overrides) per run.
RUNS: dict[str, tuple[int, list[str]]] = {
    "ep1": (1, ["parallel.tp=1"]),
    "ep2_alltoall": (2, ["parallel.tp=1", "parallel.ep=2",
                         "model.moe_token_dispatcher=alltoall"]),
    "tp2_sp_allgather": (2, ["parallel.tp=2", "parallel.sp=true",
                             "model.moe_token_dispatcher=allgather"]),
    # Stage 0 holds the MoE layer, stage 1 the dense one (the MoE layers are chosen by global
    # layer index); each stage's DP=2 ranks split the experts over EP=2.
    "pp2_ep2_alltoall": (4, ["parallel.tp=1", "parallel.pp=2", "parallel.ep=2",
                             "model.moe_token_dispatcher=alltoall"]),
}
# EP only moves whole experts between ranks and the dispatcher only moves tokens: the sums are
# the same up to the order of the dense DP reduction. Measured 8.7e-7 (an expert's fc2; the
# dense layer and the shared expert 4.8e-7 and 4.0e-7; losses bitwise equal); ~5x headroom.
# PP=2 x EP=2 (the pipeline moves activations, not sums): 7.9e-7, losses bitwise.
MOE_EP_WEIGHT_REL_TOL = 5e-6
# TP=2 splits every expert's rows/columns and reduces row-parallel partial sketches over TP;
# RowAdam's per-row normalisation amplifies that rounding in rows with small moments. Measured
# 1.6e-5 after 3 steps (the dense TP=2 suite measures 3.5e-6 after 6; the experts' rows see
# fewer tokens, so their moments are smaller). With one MoE layer, a dense one and a shared
# expert the largest is 9.9e-6 (the output layer; the router 2.5e-6). A routing flip would give
# O(1e-2).
MOE_TP_WEIGHT_REL_TOL = 6e-5


# The paper's method on MoE (logra.mode=paper: the paper's RowAdam per expert, one joint update
# ratio, non-targets -- the router too -- frozen) under predicted-KL step control, at EP=2 and
# at TP=2 (the probe's tangents through the expert all-to-all both ways, or the all-gather
# dispatcher's TP x EP gather and reduce-scatter, and the expert linears' local tangents) against
# EP=1. The update ratio proposes more than the budget, so alpha < 1 at every step: alpha is the
# probe's prediction at work. Probe sequences 0, 1, 2, 4, 5, 6 of the global batch of 8 (evenly
# spaced): 3 + 3 over the two DP ranks at EP=2 (the all-to-all carries the other rank's
# tokens). fp32 factors: bf16 rounding
# of the factor can flip an ulp between layouts (as in e2e/test_kl_control.py).
PAPER = ["logra.mode=paper", "logra.update_ratio=3e-2", "logra.update_factor_dtype=fp32"]
KL_CONTROL = [*PAPER, "logra.kl_control.enabled=true", "logra.kl_control.kl_budget=1e-5",
              "logra.kl_control.kl_budget_final=1e-5", "logra.kl_control.probe_responses=6"]
KL_RUNS: dict[str, tuple[int, list[str]]] = {
    f"kl_{name}": (RUNS[name][0], [*RUNS[name][1], *KL_CONTROL])
    for name in ("ep1", "ep2_alltoall", "tp2_sp_allgather")
}
# The Fisher form is the KL's second-order term: at a per-token KL of 1e-4 the third-order
# remainder is ~1% (e2e/test_kl_control.py measures 0.1-2% on the dense model); 5% flags a
# prediction that misses a term, not curvature.
KL_PREDICTION_REL_TOL = 5e-2
# One paper step with many idle experts: 64 experts, top-2, one sequence of 32 tokens per DP rank
# (at most 128 expert slots, so about a third of the experts get no token), EP=2.
PAPER_IDLE_RATIO = 1e-2
PAPER_IDLE = (2, ["parallel.tp=1", "parallel.ep=2", "model.num_moe_experts=64", "train.steps=1",
                  "train.global_batch_size=2", "train.micro_batch_size=1", *PAPER,
                  f"logra.update_ratio={PAPER_IDLE_RATIO}"])
# ||W1 - W0|| / ||W0|| over the moved targets against the ratio: the merge's fp32 rounding of
# W0 + dW (6e-8 of each entry, in a change of 1e-2 of it) and the float64 norms. Measured 3.7e-8
# (33 of the 64 experts idle; over all targets the ratio would be 7.5e-3).
PAPER_RATIO_REL_TOL = 1e-6


# bf16 parameters with exact fp32 masters sharded by rows (issue 16), in paper mode under the KL
# controller (so the sharded experts' row statistics, reduced over expert TP and then expert-DP,
# and the probe's all-gather of the sharded directions run too): at EP=1 on two ranks the
# experts' masters are sharded over the expert-data-parallel group (= DP, 2 ranks); at EP=2 that
# group is one rank (each rank owns all rows of its experts) while the dense masters are sharded
# over DP=2 in both. One store per run, so the three are all exercised: host (EP=1), remainder
# (EP=2, checkpointed), dp_sharded (the EP=2 resume). The fp32 reference is the paper-mode KL
# run at EP=1.
BF16 = ["model.params_dtype=bf16", *KL_CONTROL]
BF16_RUNS: dict[str, tuple[int, list[str]]] = {
    "bf16_ep1_dp2": (2, ["parallel.tp=1", *BF16, "logra.master_weights=host"]),
    "bf16_ep2_alltoall": (2, ["parallel.tp=1", "parallel.ep=2",
                              "model.moe_token_dispatcher=alltoall", *BF16,
                              "logra.master_weights=remainder"]),
}
# bf16 EP=2 vs EP=1 (both DP=2): the dense part is the same computation; an expert's sketch is
# one matmul over its tokens at EP=2 and a sum of two ranks' partial sketches at EP=1, in fp32,
# so a few bf16 weight entries can round the other way. Measured here: losses and weights bitwise
# equal (in library mode at lr 1e-2: losses bitwise, the largest per-tensor norm error 9.7e-6, an
# expert's fc1). One bf16 ulp on every entry would be ~4e-3, a missing or doubled share of a
# sketch O(1). Against fp32 (measured): losses 2.5e-5, the largest per-tensor norm error 3.9e-3
# (an expert's fc2; dense 2.5e-3), within the bf16-vs-fp32 bounds. In library mode at a larger
# step the experts leave those bounds (docs/moe.md: bf16 flips some tokens' expert choice).
BF16_EP_WEIGHT_NORM_REL_TOL = 1e-4


IDENTITY = ["parallel.tp=1", "parallel.ep=2", "optimizer.lr=0.2", "optimizer.sgd_momentum=0.0",
            "optimizer.weight_decay=0.01", f"optimizer.clip_grad={SGD_PARITY_CLIP}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("moe"), "train", CONFIG, BASE, synthetic_data_dir)


def _run(runs: CliRuns, name: str):
    if name in BF16_RUNS:
        nproc, overrides = BF16_RUNS[name]
        checkpoint = name == "bf16_ep2_alltoall"  # the resume forks its step-2 checkpoint
        return runs.run(name, nproc, [*overrides, f"checkpoint.interval={RESUME_AFTER}"]
                        if checkpoint else overrides, checkpointed=checkpoint)
    nproc, overrides = RUNS[name]
    if name == "ep2_alltoall":  # its checkpoint of step RESUME_AFTER is the resume's start
        return runs.run(name, nproc, [*overrides, f"checkpoint.interval={RESUME_AFTER}"],
                        checkpointed=True)
    return runs.run(name, nproc, overrides)


@pytest.mark.parametrize(
    ("candidate", "weight_tol"),
    [("ep2_alltoall", MOE_EP_WEIGHT_REL_TOL), ("tp2_sp_allgather", MOE_TP_WEIGHT_REL_TOL),
     ("pp2_ep2_alltoall", MOE_EP_WEIGHT_REL_TOL)],
)
def test_moe_logra_training_is_layout_invariant(candidate, weight_tol, runs):
    loss_err, weight_err = run_differences(_run(runs, candidate), _run(runs, "ep1"),
                                           max_entry_rel_err)
    assert loss_err < LOGRA_LAYOUT_LOSS_REL_TOL, f"{candidate}: loss rel err {loss_err:.2e}"
    assert weight_err < weight_tol, f"{candidate}: weight rel err {weight_err:.2e}"


def _initial_weight(cfg, name: str, shape) -> torch.Tensor:
    """``name``'s layout-invariant initial value, regenerated from the seed as the model
    builder draws it."""
    from megatron_logra.mcore.models.gpt import _init_rule, _name_seed

    _, std = _init_rule(name, cfg.model)
    generator = torch.Generator().manual_seed(_name_seed(cfg.train.seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def test_moe_reference_run_has_a_dense_layer_and_a_shared_expert_and_moves_every_expert(runs):
    """Guards the comparisons against runs that did not train what they claim to compare:
    layer 1 is dense and layer 0 is MoE with a shared expert (so ``model.moe_layer_freq`` and
    ``model.moe_shared_expert_ffn_hidden_size`` act), every routed expert's fc1 and fc2 (under
    its global name) differs from its initial value -- an expert moves only in a step where it
    received tokens, so every expert received tokens in some step -- as do the shared expert
    and the dense MLP, and the loss went down."""
    from megatron_logra.config import load_config

    reference = _run(runs, "ep1")
    records = read_metrics(reference / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"]
    cfg = load_config(CONFIG, [*BASE, "parallel.tp=1"])
    after = torch.load(reference / "full_weights.pt")
    expert_params = [n for n in after if ".mlp.experts." in n]
    assert {int(n.split(".")[2]) for n in expert_params} == set(MOE_LAYERS), expert_params
    assert "decoder.layers.1.mlp.linear_fc1.weight" in after  # the dense layer's MLP
    # The shared expert is SwiGLU of width 32: fc1 stacks gate and up, [2 * 32, hidden].
    shared_fc1 = after["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert shared_fc1.shape == (64, TINY_GPT["hidden_size"]), shared_fc1.shape
    names = ["decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight",
             "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
             "decoder.layers.0.mlp.shared_experts.linear_fc2.weight"]
    for layer in MOE_LAYERS:
        for expert in range(NUM_EXPERTS):
            for linear in ("linear_fc1", "linear_fc2"):
                names.append(
                    f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}.weight")
    for name in names:
        before = _initial_weight(cfg, name, after[name].shape)
        assert not torch.allclose(before, after[name], rtol=0, atol=1e-6), f"{name} did not move"
        # ... and the regenerated value is the initial one (the guard can fail).
        assert (after[name] - before).abs().max() < 0.2, f"{name}: not its initial draw"


def test_identity_projection_on_moe_reproduces_megatron_sgd_at_ep2_except_idle_experts(runs):
    """Losses, gradient norms (clipping binding) and every weight as Megatron's SGD -- except
    the experts that received no token in some step: Megatron's SGD still decays those
    (``W <- (1 - lr wd) W`` with a zero gradient), LoGRA leaves them alone (docs/moe.md). Such an
    expert's Megatron weight is its LoGRA weight times one constant factor below 1 (its missed
    decays), fitted by least squares and then held to the parity bound. This run shows it for 1
    of the 4 experts (seeded routing at lr 0.2: idle in the last step, factor 0.999498 = 1 - lr
    wd at that step's cosine-decayed lr; 5.0e-4 from Megatron before the factor, 2.1e-7 after;
    every other tensor within 2.7e-7 of Megatron). An elementwise ratio would not do: the
    experts' earlier-step rounding (1e-7 of the largest entry) divided by the tensor's smallest
    entries spreads it to 2e-5."""
    dense = runs.run("sgd_ep2", 2, [*IDENTITY, "optimizer.name=sgd"])
    logra = runs.run("identity_ep2", 2, [*IDENTITY, *LOGRA_IDENTITY])
    w_got, w_want = sgd_parity_weights(dense, logra, steps=STEPS)
    idle = []
    for name, tensor in w_want.items():
        err = max_entry_rel_err(w_got[name], tensor)
        if err < SGD_PARITY_WEIGHT_REL_TOL:
            continue
        assert ".mlp.experts." in name, f"{name}: {err:.2e}"
        # The one factor, fitted by least squares; the rest must be parity noise.
        factor = float((tensor * w_got[name]).sum() / (w_got[name] * w_got[name]).sum())
        assert factor < 1.0, f"{name}: factor {factor}"
        scaled_err = max_entry_rel_err(factor * w_got[name], tensor)
        assert scaled_err < SGD_PARITY_WEIGHT_REL_TOL, f"{name}: {factor} {scaled_err:.2e}"
        idle.append(name.removesuffix(".linear_fc1.weight").removesuffix(".linear_fc2.weight"))
    assert idle, "no expert was idle: the run no longer exercises the idle-expert rule"
    assert all(idle.count(expert) == 2 for expert in idle), idle  # fc1 and fc2 together


def test_moe_resume_resharded_from_ep2_to_ep1_equals_the_uninterrupted_run(runs):
    _run(runs, "ep2_alltoall")
    resumed = runs.forked("ep2_to_ep1", "ep2_alltoall", RESUME_AFTER, RUNS["ep1"])
    records = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    loss_err, weight_err = run_differences(resumed, _run(runs, "ep1"), max_entry_rel_err)
    assert loss_err < RESHARD_LOSS_REL_TOL, f"loss rel err {loss_err:.2e}"
    assert weight_err < RESHARD_WEIGHT_REL_TOL, f"weight rel err {weight_err:.2e}"


def test_expert_state_estimate_equals_what_ep2_removes_from_each_rank(runs):
    """The estimator's expert terms against the bytes the built optimizer holds
    (``state_bytes.json``): going from EP=1 to EP=2 moves half of the experts off each rank and
    changes nothing else of a rank's persistent state (the dense parts are replicated over DP,
    fp32, no distributed optimizer), so the measured difference per category is exactly the
    estimate's difference -- every per-expert term (fp32 weights, no gradient, one RowAdam
    moment per row, an ``[m, r]`` sketch and an ``[r, n]`` projection per expert linear)."""
    import json

    from megatron_logra.config import load_config
    from megatron_logra.memory.experts import expert_shape_from_model_config, expert_state_bytes

    def measured(name: str) -> dict[str, int]:
        per_rank = json.loads((_run(runs, name) / "state_bytes.json").read_text())["per_rank"]
        assert all(rank == per_rank[0] for rank in per_rank), per_rank
        return per_rank[0]

    cfg = load_config(CONFIG, [*BASE, "parallel.tp=1"])
    shape = expert_shape_from_model_config(cfg.model)
    assert shape.moe_layers == len(MOE_LAYERS)

    def estimate(ep: int) -> dict[str, float]:
        return expert_state_bytes(shape, method="logra", precision="fp32", ep=ep,
                                  sketch_rank=cfg.logra.sketch_rank)

    ep1, ep2 = measured("ep1"), measured("ep2_alltoall")
    want, got = estimate(1), estimate(2)
    for category, key in (("weights", "weights"), ("gradients", "grads"),
                          ("optimizer_state", "optimizer_state"), ("sketches", "sketches"),
                          ("projections", "projections")):
        assert ep1[key] - ep2[key] == want[category] - got[category], category
    assert want["weights"] > 0 and want["sketches"] > 0 and want["projections"] > 0


@pytest.mark.parametrize(
    ("candidate", "weight_tol"),
    [("kl_ep2_alltoall", MOE_EP_WEIGHT_REL_TOL), ("kl_tp2_sp_allgather", MOE_TP_WEIGHT_REL_TOL)],
)
def test_paper_mode_with_predicted_kl_control_on_moe_is_layout_invariant(candidate, weight_tol,
                                                                         runs):
    """alpha, the predicted and the realised KL, the losses and every weight at EP=2 and at TP=2
    as at EP=1, in paper mode under the predicted-KL controller: the probe's forward-mode
    tangent crosses the dispatcher's collectives with the primal, and each expert's linear adds
    its own local tangent (no TP collective of its own: the dispatcher does them) -- a lost or
    doubled term would change the predicted KL by O(1), and the realised KL would leave the
    prediction. The paper's per-expert row statistics and its joint ratio are the same sums at
    every layout."""
    want_run, got_run = (runs.run(name, *KL_RUNS[name]) for name in ("kl_ep1", candidate))
    want, got = read_metrics(want_run / "metrics.jsonl"), read_metrics(got_run / "metrics.jsonl")
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want, strict=True):
        assert b["alpha"] < 1.0, b  # the budget binds: alpha comes from the prediction
        assert abs(b["kl_realized"] / b["kl_predicted_scaled"] - 1) < KL_PREDICTION_REL_TOL, b
        for field, tol in (("alpha", KL_CONTROL_LAYOUT_ALPHA_REL_TOL),
                           ("kl_predicted", KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL),
                           ("kl_realized", KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL),
                           ("loss", LOGRA_LAYOUT_LOSS_REL_TOL)):
            err = abs(a[field] - b[field]) / abs(b[field])
            assert err < tol, (a["step"], field, a[field], b[field], f"{err:.2e}")
    _, weight_err = run_differences(got_run, want_run, max_entry_rel_err)
    assert weight_err < weight_tol, f"{candidate}: weight rel err {weight_err:.2e}"


def test_paper_step_leaves_idle_experts_unchanged_and_sizes_the_moved_targets_by_the_ratio(runs):
    """One paper step at EP=2 with 64 experts and few tokens: every expert that received no token
    is bit for bit its initial draw (fc1 and fc2 together), every other target moved, the
    non-targets (the router too) are frozen, and the joint update ratio holds over the targets
    that moved -- ``||W1 - W0|| = ratio * ||W0||`` over them, not over all targets (which,
    with the idle experts' weights counted, would be larger by the factor asserted below)."""
    from megatron_logra.config import load_config

    run = runs.run("paper_idle_ep2", *PAPER_IDLE)
    cfg = load_config(CONFIG, [*BASE, *PAPER_IDLE[1]])
    after = torch.load(run / "full_weights.pt")
    moved_sq = before_moved_sq = before_all_sq = 0.0
    idle = set()
    for name, tensor in after.items():
        before = _initial_weight(cfg, name, tensor.shape)
        target = name.endswith(("linear_fc1.weight", "linear_fc2.weight", "linear_qkv.weight",
                                "linear_proj.weight"))
        if not target:
            if name.endswith(".weight") and "layernorm" not in name and "norm" not in name:
                assert torch.equal(tensor, before), f"{name}: a non-target moved in paper mode"
            continue
        before_all_sq += float(before.double().pow(2).sum())
        if torch.equal(tensor, before):
            assert ".mlp.experts." in name, f"{name}: a dense target did not move"
            idle.add(name.rsplit(".", 2)[0])
            continue
        moved_sq += float((tensor.double() - before.double()).pow(2).sum())
        before_moved_sq += float(before.double().pow(2).sum())
    experts = {n.rsplit(".", 2)[0] for n in after if ".mlp.experts." in n}
    assert len(experts) == 64 and 8 <= len(idle) <= 40, len(idle)
    for expert in idle:  # both linears of an idle expert, none of an active one
        assert torch.equal(after[f"{expert}.linear_fc2.weight"], _initial_weight(
            cfg, f"{expert}.linear_fc2.weight", after[f"{expert}.linear_fc2.weight"].shape))
    ratio = (moved_sq / before_moved_sq) ** 0.5
    assert abs(ratio / PAPER_IDLE_RATIO - 1) < PAPER_RATIO_REL_TOL, ratio
    # The other definition is far outside the tolerance: the test tells them apart.
    assert (before_all_sq / before_moved_sq) ** 0.5 - 1 > 100 * PAPER_RATIO_REL_TOL


def test_bf16_experts_with_sharded_masters_at_ep2_equal_ep1_and_track_fp32(runs):
    """bf16 parameters, exact fp32 masters: the experts' masters sharded over the
    expert-data-parallel group (2 ranks at EP=1, 1 at EP=2) and the dense ones over DP -- EP=2
    equals EP=1 to bf16 rounding of a few entries, both track the fp32 run to the project's
    bf16-vs-fp32 bounds, and each rank holds a half of every master row (the host store's
    bytes: the dense targets' rows over DP=2, the experts' over expert-DP=2 at EP=1)."""
    import json

    ep1, ep2 = _run(runs, "bf16_ep1_dp2"), _run(runs, "bf16_ep2_alltoall")
    loss_err, weight_err = run_differences(ep2, ep1, norm_rel_err)
    assert loss_err < LOGRA_LAYOUT_LOSS_REL_TOL, f"loss rel err {loss_err:.2e}"
    assert weight_err < BF16_EP_WEIGHT_NORM_REL_TOL, f"weight rel err {weight_err:.2e}"
    fp32 = runs.run("kl_ep1", *KL_RUNS["kl_ep1"])
    for candidate in (ep1, ep2):
        loss_err, weight_err = run_differences(candidate, fp32,
                                               lambda a, b: norm_rel_err(a.float(), b.float()))
        assert loss_err < BF16_VS_FP32_LOSS_REL_TOL, f"{candidate.name}: loss {loss_err:.2e}"
        assert weight_err < BF16_VS_FP32_WEIGHT_NORM_REL_TOL, (
            f"{candidate.name}: weight {weight_err:.2e}")
    # The runs trained bf16 experts (the saved weights are bf16 values, the fp32 run's are not).
    weights = {run: torch.load(run / "full_weights.pt") for run in (ep1, fp32)}
    for name in weights[ep1]:
        if ".mlp.experts." in name:
            w16, w32 = weights[ep1][name], weights[fp32][name]
            assert torch.equal(w16.bfloat16().float(), w16), name
            assert not torch.equal(w32.bfloat16().float(), w32), name
    targets = [n for n in weights[ep1] if n.endswith(("linear_fc1.weight", "linear_fc2.weight",
                                                       "linear_qkv.weight", "linear_proj.weight"))]
    elements = sum(weights[ep1][n].numel() for n in targets)
    per_rank = json.loads((ep1 / "state_bytes.json").read_text())["per_rank"]
    assert [r["host_optimizer_state"] for r in per_rank] == [4 * elements // 2] * 2, per_rank


def test_bf16_moe_resume_with_another_master_store_is_exact(runs):
    """The bf16 EP=2 run's step-2 checkpoint (remainder masters, written as fp32 rows) resumed
    with dp_sharded masters for the last step: losses, alpha and every weight bit for bit the
    uninterrupted run's -- the experts' masters, row moments and the controller's state come
    back exactly, whatever the store."""
    full = _run(runs, "bf16_ep2_alltoall")
    nproc, overrides = BF16_RUNS["bf16_ep2_alltoall"]
    other = [o for o in overrides if not o.startswith("logra.master_weights=")]
    resumed = runs.forked("bf16_ep2_resumed_dp_sharded", "bf16_ep2_alltoall", RESUME_AFTER,
                          (nproc, [*other, "logra.master_weights=dp_sharded"]))
    want, got = read_metrics(full / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for field in ("loss", "alpha", "kl_predicted"):
        assert [r[field] for r in got] == [r[field] for r in want], field
    w_want, w_got = torch.load(full / "full_weights.pt"), torch.load(resumed / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    for name, tensor in w_want.items():
        assert torch.equal(w_got[name], tensor), name
