"""Command line: ``megatron-logra {train,sft,rl} CONFIG.yaml [section.key=value ...]``, and
``megatron-logra check --world-size N {train,sft,rl} CONFIG.yaml ...`` (validation only).

Launch several processes with torchrun::

    torchrun --nproc_per_node=2 -m megatron_logra train configs/demo_cpu.yaml parallel.tp=2

The configuration is loaded, overridden and validated against the world size before any process
group is created, so a bad value fails in a second with a message naming the field.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from megatron_logra.config import load_config


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s r{rank} %(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    # Megatron-Core logs its full configs and parameter lists at INFO; keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # Megatron-Core announces at import that apex and Transformer Engine are absent and that it
    # falls back to torch implementations; on CPU that is the expected configuration.
    for pattern in (".*Apex.*", ".*[Tt]ransformer [Ee]ngine.*", ".*apex.*", ".*multi_tensor.*"):
        warnings.filterwarnings("ignore", message=pattern)


def _checked_config(command: str, config: str, overrides: list[str], world_size: int):
    """The resolved config of a ``command`` run at ``world_size``, and for ``rl`` the separate
    engine's installation checked: ValueError naming the field, the value and the fix."""
    cfg = load_config(config, overrides, command=command).resolved(world_size, command)
    if command == "rl":
        from megatron_logra.rollout.factory import check_engine_setup

        check_engine_setup(cfg)  # a vLLM venv that cannot run, before any rank builds
    return cfg


def _configuration_error(error: ValueError) -> int:
    # Every rank finds the same error; one message per node (not one per rank) says it.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"megatron-logra: configuration error: {error}", file=sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    """What the launch scripts run before torchrun starts any rank."""
    try:
        _checked_config(args.run_command, args.config, args.overrides, args.world_size)
    except ValueError as error:
        return _configuration_error(error)
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        # The world torchrun announces (1 for a plain launch). Read here, not through the
        # process-group module: a refusal must not wait for Megatron to import.
        cfg = _checked_config(args.command, args.config, args.overrides,
                              int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as error:
        return _configuration_error(error)
    from megatron_logra.train.supervised import train

    try:
        if args.command == "rl":
            from megatron_logra.train.rl import rl

            rl(cfg)
        else:
            train(cfg)
    except ValueError as error:
        # A user-fixable problem found once the run started (e.g. a checkpoint written with
        # other settings): say what and how to fix it, without a traceback per rank.
        print(f"megatron-logra: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-logra", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="supervised training (dense or LoGRA)")
    train_parser.add_argument("config", help="YAML config file")
    train_parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train_parser.set_defaults(handler=_train)
    sft_parser = commands.add_parser(
        "sft", help="supervised warm start on prompt/answer data; writes <run.dir>/model"
    )
    sft_parser.add_argument("config", help="YAML config file")
    sft_parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    sft_parser.set_defaults(handler=_train)
    rl_parser = commands.add_parser(
        "rl", help="RL post-training (paper REINFORCE or GRPO) with LoGRA or a dense optimizer"
    )
    rl_parser.add_argument("config", help="YAML config file")
    rl_parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    rl_parser.set_defaults(handler=_train)
    check_parser = commands.add_parser(
        "check", help="validate a run's configuration (and a vLLM engine's venv) for a world "
        "size without starting it: exit 0, or 2 with the error"
    )
    check_parser.add_argument("--world-size", type=int, required=True,
                              help="processes the run will have (nodes x processes per node)")
    check_parser.add_argument("run_command", choices=("train", "sft", "rl"))
    check_parser.add_argument("config", help="YAML config file")
    check_parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    check_parser.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    _configure_logging()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
