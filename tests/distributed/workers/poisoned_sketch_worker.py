"""A NaN in one sketch must stop the step before anything changes (run with torchrun).

Builds the real training setup (paper mode + KL control, or library mode), runs one real
forward/backward through Megatron's schedule, poisons one sketch entry, and calls the optimizer
step. Writes ``--out/result.json``: the exception raised, whether every parameter is
bit-identical to before, the update count, and whether the KL controller was consulted.
"""

from __future__ import annotations

import torch
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.training.forward_backward import forward_backward
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import _forward_step
from megatron_logra.probe_batch import ProbeBatch
from tests.presets import tiny_kl_controlled_logra


def build_cfg(args, world: int):
    return load_config(None, tiny_kl_controlled_logra(world, args.mode, args.data)).resolved(world)


def measure(args, cfg, groups):
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=32, global_batch_size=4,
                               seed=cfg.train.seed)
    setup = setup_training(cfg, build_model_chunks(cfg, groups, tokenizer.vocab_size), groups,
                           kl_vocab_size=tokenizer.vocab_size)
    control = setup.kl_control
    consulted = []

    class Spy:
        """The real KL step control, recording that the optimizer consulted it."""

        def __call__(self, proposal):
            consulted.append(True)
            return control(proposal)

    setup.logra.step_scale = Spy()

    for chunk in setup.model_chunks:
        chunk.zero_grad_buffer()
    setup.optimizer.zero_grad()
    batches = schedule.microbatches(0, dp_rank=0, dp_size=1, micro_batch_size=4)
    control.set_batch(ProbeBatch.from_rows(batches[0].tokens, batches[0].position_ids,
                                           batches[0].loss_mask > 0))
    forward_backward(setup.model_chunks, batches, _forward_step, seq_length=32,
                     micro_batch_size=4)
    before = {name: p.detach().clone() for chunk in setup.model_chunks
              for name, p in chunk.named_parameters()}
    # One entry of one layer's reduced sketch becomes NaN (as a bad batch or overflow would).
    setup.logra.sketches.data[3] = float("nan")
    error = None
    try:
        setup.optimizer.step()
    except RuntimeError as exc:
        error = str(exc)
    after = {name: p.detach() for chunk in setup.model_chunks
             for name, p in chunk.named_parameters()}
    return {
        "error": error,
        "weights_unchanged": all(torch.equal(before[n], after[n]) for n in before),
        "update_count": setup.logra.update_count,
        "controller_consulted": bool(consulted),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--mode", choices=["paper", "library"], required=True)


if __name__ == "__main__":
    run_worker({"poisoned_sketch": Case(build_cfg, measure)}, add_arguments)
