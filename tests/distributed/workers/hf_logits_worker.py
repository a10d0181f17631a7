"""Logits of converted Hugging Face models, built and loaded as a training run would.

Run under torchrun with tp * pp processes. For each converted directory (``tools/convert_hf.py
to-megatron`` output) the worker loads its ``model.yaml`` with the layout overrides, builds this
rank's chunks with ``build_model_chunks``, loads the weights with ``load_model_weights`` from
``model.init_checkpoint`` (what the trainer does), runs a forward-only pass through Megatron's
pipeline schedule on the tokens in ``--tokens`` and gathers the vocab-parallel logits. The rank
holding the last stage's first TP shard saves ``<out>/<name>.pt``: logits ``[batch, seq, vocab]``
with Megatron's vocabulary padding stripped.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.mcore.checkpointing.checkpoint import load_model_weights
from megatron_logra.mcore.conversion.hf import HF_SOURCE_FILE, MODEL_YAML
from megatron_logra.mcore.models.gpt import build_model_chunks


def _collect_logits(output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
    if not non_loss_data:
        raise RuntimeError("the schedule must be run with collect_non_loss_data=True")
    return output.detach()


def _forward_step(tokens: torch.Tensor, data_iterator, model):
    del data_iterator
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens).contiguous()
    return model(tokens, positions, None), _collect_logits


def build_configs(args, world: int) -> dict:
    """Every converted model's config at the ``--tp`` / ``--pp`` layout, by directory name."""
    batch, seq = torch.load(args.tokens).shape
    layout = ["parallel.device=cpu", f"parallel.tp={args.tp}", f"parallel.pp={args.pp}",
              f"model.seq_length={seq}", f"train.micro_batch_size={batch}",
              f"train.global_batch_size={batch}"]
    return {path.name: load_config(path / MODEL_YAML, layout).resolved(world)
            for path in args.converted}


def measure(args, _first_cfg, groups) -> None:
    """Writes ``<out>/<name>.pt`` per converted model."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.load(args.tokens)
    batch, seq = tokens.shape
    configs = build_configs(args, groups.world_size)
    for path in args.converted:
        cfg = configs[path.name]
        vocab = json.loads((path / HF_SOURCE_FILE).read_text())["config"]["vocab_size"]
        chunks = build_model_chunks(cfg, groups, vocab_size=vocab)
        load_model_weights(cfg.model.init_checkpoint, model_chunks=chunks, cfg=cfg,
                           groups=groups)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            collected = get_forward_backward_func()(
                forward_step_func=functools.partial(_forward_step, tokens),
                data_iterator=None, model=chunks, num_microbatches=1, seq_length=seq,
                micro_batch_size=batch, forward_only=True, collect_non_loss_data=True,
            )
        if groups.pp_rank != groups.pp_size - 1:
            continue
        (shard,) = collected
        pieces = [torch.empty_like(shard) for _ in range(groups.tp_size)]
        dist.all_gather(pieces, shard.contiguous(), group=groups.tp)
        logits = torch.cat(pieces, dim=-1)[..., :vocab]
        if groups.tp_rank == 0 and groups.dp_rank == 0:
            torch.save(logits.float().clone(), args.out / f"{path.name}.pt")


def add_arguments(parser) -> None:
    parser.add_argument("--converted", nargs="+", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)


def first_config(args, world: int):
    """The config the process groups are set up with: every model shares --tp / --pp."""
    return next(iter(build_configs(args, world).values()))


if __name__ == "__main__":
    run_worker({"hf_logits": Case(first_config, measure)}, add_arguments)
