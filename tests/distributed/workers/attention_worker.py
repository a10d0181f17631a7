"""Measure ``model.attention=sdpa`` against Megatron's ``DotProductAttention`` (``local``).

Run under torchrun with 1 or 2 processes; ``--tp`` and ``--sp`` pick the layout. Rank 0 writes
``--out/result.json``:

* ``model``: per dtype (float64, float32), two GPTs with the same seed (hence the same weights)
  and grouped-query attention (4 heads, 2 query groups: one group of two heads per TP=2 rank),
  one with each attention; max relative differences of this rank's logits and of the gradients
  of the word embeddings (the model's input gradient) and of layer 0's ``linear_qkv`` weight
  (the gradient of the attention inputs, projected back) after a backward of a fixed random
  linear function of the logits;
* ``module``: per mask case (causal prefill, an explicit padding mask, a KV-cache decode row),
  layer 0's two core-attention modules called directly on the same random local-head inputs in
  float64: max relative differences of the output and of the query/key/value gradients;
* ``memory`` (TP=1 only): a 1-layer GPT of width 32 in float32, batch 1, at 1k-8k tokens (local:
  1k and 2k, its scores alone are 256 MiB at 4k): the bytes autograd saves for backward during
  the core-attention call (new storages counted by the live-tensor tracker; the query, key and
  value it also saves exist before the call) and during the whole forward.
"""

from __future__ import annotations

import dataclasses

import torch
from harness import Case, run_worker
from megatron.core.transformer.enums import AttnMaskType

from megatron_logra.config import load_config
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.memory.live_tensors import ACTIVATIONS, LiveTensorTracker
from tests.layouts import max_entry_rel_err, tp_sp
from tests.presets import NARROW, tiny_gpt

VOCAB = 100
SEQ, MICRO_BATCH = 16, 2


def build_cfg(args, world: int):
    overrides = [
        "parallel.device=cpu", *tp_sp(args.tp, args.sp), *tiny_gpt(**NARROW, seq_length=SEQ),
        "model.num_query_groups=2", "model.activation=swiglu",
        f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH}",
    ]
    return load_config(None, overrides).resolved(world)


def with_attention(cfg, attention: str):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=attention))


def measure_model(cfg, groups, dtype):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
    results = {}
    for attention in ("sdpa", "local"):
        model = build_model(with_attention(cfg, attention), groups, VOCAB).to(dtype)
        logits = model(tokens, positions, None)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4),
                              dtype=dtype)
        (logits * weights).sum().backward()
        results[attention] = {
            "logits": logits.detach(),
            "embedding_grad": model.embedding.word_embeddings.weight.grad,
            "qkv_grad": model.decoder.layers[0].self_attention.linear_qkv.weight.grad,
        }
    sdpa, local = results["sdpa"], results["local"]
    return {name: max_entry_rel_err(sdpa[name], local[name]) for name in sdpa}


def measure_module(cfg, groups):
    sdpa_model = build_model(with_attention(cfg, "sdpa"), groups, VOCAB).double()
    local_model = build_model(with_attention(cfg, "local"), groups, VOCAB).double()
    sdpa = sdpa_model.decoder.layers[0].self_attention.core_attention
    local = local_model.decoder.layers[0].self_attention.core_attention
    heads = cfg.model.num_attention_heads // groups.tp_size
    kv_heads = cfg.model.query_groups // groups.tp_size
    head_dim = cfg.model.hidden_size // cfg.model.num_attention_heads
    generator = torch.Generator().manual_seed(5)
    padding = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.bool)
    padding[0, :3] = True  # sequence 0 is left-padded by 3 positions
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    cases = {
        # (queries, keys, mask (True = masked), mask type)
        "causal": (SEQ, SEQ, None, AttnMaskType.causal),
        "padding_mask": (SEQ, SEQ, ~causal[None, None] | padding[:, None, None, :],
                         AttnMaskType.causal),
        "decode": (1, SEQ, padding[:, None, None, :], AttnMaskType.no_mask),
    }
    out = {}
    for name, (s_q, s_k, mask, mask_type) in cases.items():
        def draw(s, n):
            return torch.randn(s, MICRO_BATCH, n, head_dim, generator=generator,
                               dtype=torch.float64)
        inputs = (draw(s_q, heads), draw(s_k, kv_heads), draw(s_k, kv_heads))
        grad_out = torch.randn(s_q, MICRO_BATCH, heads * head_dim, generator=generator,
                               dtype=torch.float64)
        if mask is not None:
            # Rows whose keys are all masked (left padding) are never read: Megatron averages
            # the values there, SDPA gives zeros. Compare on the rows that see a key.
            seen = (~mask).any(dim=-1)[:, 0].transpose(0, 1)[..., None]  # [s_q, b, 1]
            grad_out = grad_out * seen
        measured = {}
        for kind, module in (("sdpa", sdpa), ("local", local)):
            leaves = [t.clone().requires_grad_() for t in inputs]
            output = module(*leaves, mask, attn_mask_type=mask_type)
            output.backward(grad_out)
            if mask is not None:
                output = output * seen
            measured[kind] = [output.detach()] + [t.grad for t in leaves]
        errors = [max_entry_rel_err(a, b) for a, b in zip(measured["sdpa"], measured["local"],
                                                          strict=True)]
        out[name] = dict(zip(("output", "query_grad", "key_grad", "value_grad"), errors,
                             strict=True))
    return out


MEMORY_LENGTHS = {"sdpa": (1024, 2048, 4096, 8192), "local": (1024, 2048)}


def saved_bytes(model, length: int) -> tuple[int, int]:
    """Bytes saved for backward ``(during core attention, during the whole forward)``."""
    core = model.decoder.layers[0].self_attention.core_attention
    tracker = LiveTensorTracker()
    marks: list[int] = []

    def mark(*_) -> None:
        marks.append(tracker.report().live_by_category[ACTIVATIONS])

    core.register_forward_pre_hook(mark)
    core.register_forward_hook(mark)
    tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator())
    with tracker:
        logits = model(tokens, torch.arange(length)[None], None)
    saved = tracker.report().live_by_category[ACTIVATIONS]
    del logits
    return marks[1] - marks[0], saved


def measure_memory(cfg, groups):
    out: dict[str, dict[str, dict[int, int]]] = {}
    for attention, lengths in MEMORY_LENGTHS.items():
        out[attention] = {"core_attention": {}, "forward": {}}
        for length in lengths:
            model_cfg = dataclasses.replace(cfg.model, num_layers=1, seq_length=length,
                                            attention=attention)
            model = build_model(dataclasses.replace(cfg, model=model_cfg), groups, VOCAB)
            core, forward = saved_bytes(model, length)
            out[attention]["core_attention"][length] = core
            out[attention]["forward"][length] = forward
    return out


def measure(args, cfg, groups):
    return {
        "memory": measure_memory(cfg, groups) if groups.tp_size == 1 else None,
        "layout": {"tp": groups.tp_size, "sp": args.sp},
        "model": {"float64": measure_model(cfg, groups, torch.float64),
                  "float32": measure_model(cfg, groups, torch.float32)},
        "module": measure_module(cfg, groups),
        "types": {
            "sdpa": type(build_model(cfg, groups, VOCAB).decoder.layers[0]
                         .self_attention.core_attention).__name__,
        },
    }


def add_arguments(parser) -> None:
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--sp", action="store_true")


if __name__ == "__main__":
    run_worker({"attention": Case(build_cfg, measure, world_sizes=(1, 2))}, add_arguments)
