"""The tiny GPT the tests build, as ``model.*`` CLI overrides of the nested config.

One preset, ``TINY_GPT``: 2 layers, width 64, 4 heads, FFN 128, 32 tokens -- small enough that a
torchrun job of a few steps on a loaded 2-core machine takes seconds, wide enough that TP=2 and
grouped-query shapes stay meaningful. A test that needs another size says so where it builds
its overrides: ``tiny_gpt(num_layers=4)``, or ``tiny_gpt(**NARROW, seq_length=16)`` for the
float64 workers; a test that keeps its config file's depth, heads and sequence length takes
only ``tiny_width()``.
"""

from __future__ import annotations

TINY_GPT: dict[str, int] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "seq_length": 32,
}
# Half the tiny GPT's width: the models the workers under tests/distributed/workers measure
# (float64 references and per-rank shards stay a few KB).
NARROW: dict[str, int] = {"hidden_size": 32, "ffn_hidden_size": 64}
# Megatron's modern block (the demo configs' too), stated so that a change of a config file
# does not change what a comparison test trains.
SWIGLU_RMSNORM_NO_BIAS = [
    "model.activation=swiglu", "model.normalization=RMSNorm", "model.add_bias_linear=false",
]


def tiny_gpt(**sizes: int) -> list[str]:
    """The tiny GPT as ``model.*`` overrides, with ``sizes`` (keys of TINY_GPT) changed."""
    unknown = sorted(set(sizes) - set(TINY_GPT))
    if unknown:
        raise ValueError(f"tiny_gpt() sizes {unknown} are not among {sorted(TINY_GPT)}")
    return [f"model.{key}={value}" for key, value in {**TINY_GPT, **sizes}.items()]


def tiny_width() -> list[str]:
    """Only the tiny GPT's hidden and FFN sizes; everything else from the config file."""
    return [f"model.{key}={TINY_GPT[key]}" for key in ("hidden_size", "ffn_hidden_size")]


def tiny_logra_run(steps: int) -> list[str]:
    """The 4-layer tiny GPT trained on CPU by LoGRA (rank-8 sketches), ``steps`` steps of 8
    samples: the base of the whole-run comparison suites, which add their optimizer settings."""
    return [
        "parallel.device=cpu", "parallel.tp=1", *tiny_gpt(num_layers=4), *SWIGLU_RMSNORM_NO_BIAS,
        f"train.steps={steps}", "train.global_batch_size=8", "optimizer.name=logra",
        "logra.sketch_rank=8",
    ]


def tiny_kl_controlled_logra(tp: int, mode: str, data_dir: str) -> list[str]:
    """The tiny GPT trained by LoGRA (``mode``) under KL control at TP=``tp``, one microbatch of
    4: the workers that poison one stage of an update start from it."""
    return [
        "parallel.device=cpu", f"parallel.tp={tp}", *tiny_gpt(),
        "train.micro_batch_size=4", "train.global_batch_size=4",
        "optimizer.name=logra", f"logra.mode={mode}", "logra.kl_control.enabled=true",
        f"data.dir={data_dir}",
    ]
