"""Command line: ``megatron-logra {train,sft,rl} CONFIG.yaml [MORE.yaml ...] [section.key=value
...]``, and ``megatron-logra check --world-size N {train,sft,rl} CONFIG.yaml ...`` (validation
only). Several config files are laid over each other key by key, later files winning (a preset,
then the ``model.yaml`` of ``tools/convert_hf.py``); the overrides come last.

Launch several processes with torchrun::

    torchrun --nproc_per_node=2 -m megatron_logra train configs/demo_cpu.yaml parallel.tp=2

The configuration is loaded, overridden and validated against the world size before any process
group is created, and the files it names (data, tokenizer, checkpoint) are checked, so a bad value
fails in seconds with a message naming the field.
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


def _split_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """``CONFIG.yaml [MORE.yaml ...] [section.key=value ...]`` -> (files, overrides)."""
    files = []
    for index, argument in enumerate(arguments):
        if "=" in argument:
            overrides = arguments[index:]
            stray = [a for a in overrides if "=" not in a]
            if stray:
                raise ValueError(f"{stray[0]!r} follows an override; config files come first, "
                                 "then section.key=value overrides")
            break
        files.append(argument)
    else:
        overrides = []
    if not files:
        raise ValueError("no config file given; the first argument after the command is a YAML "
                         "config file")
    return files, overrides


def _checked_config(command: str, arguments: list[str], world_size: int):
    """The resolved config of a ``command`` run at ``world_size``, the files it reads (data,
    tokenizer, checkpoint; prompts that fit model.seq_length) and for ``rl`` the separate
    engine's installation checked: ValueError naming the field, the value and the fix."""
    files, overrides = _split_arguments(arguments)
    cfg = load_config(files, overrides, command=command).resolved(world_size, command)
    if command == "rl":
        from megatron_logra.rollout.factory import check_engine_setup

        check_engine_setup(cfg)  # a vLLM venv that cannot run, before any rank builds
    from megatron_logra.data.run_inputs import check_run_inputs

    for note in check_run_inputs(cfg, command):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"megatron-logra: note: {note}", file=sys.stderr)
    return cfg


def _configuration_error(error: ValueError) -> int:
    # Every rank finds the same error; one message per node (not one per rank) says it.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"megatron-logra: configuration error: {error}", file=sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    """What the launch scripts run before torchrun starts any rank."""
    try:
        _checked_config(args.run_command, args.arguments, args.world_size)
    except ValueError as error:
        return _configuration_error(error)
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        # The world torchrun announces (1 for a plain launch). Read here, not through the
        # process-group module: a refusal must not wait for Megatron to import.
        cfg = _checked_config(args.command, args.arguments,
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


ARGUMENTS_HELP = ("YAML config files (later ones override earlier ones key by key, e.g. a preset "
                  "then a converted model's model.yaml), then section.key=value overrides")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-logra", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="supervised training (dense or LoGRA)")
    train_parser.add_argument("arguments", nargs="+", metavar="ARG", help=ARGUMENTS_HELP)
    train_parser.set_defaults(handler=_train)
    sft_parser = commands.add_parser(
        "sft", help="supervised warm start on prompt/answer data; writes <run.dir>/model"
    )
    sft_parser.add_argument("arguments", nargs="+", metavar="ARG", help=ARGUMENTS_HELP)
    sft_parser.set_defaults(handler=_train)
    rl_parser = commands.add_parser(
        "rl", help="RL post-training (paper REINFORCE or GRPO) with LoGRA or a dense optimizer; "
        "writes <run.dir>/model"
    )
    rl_parser.add_argument("arguments", nargs="+", metavar="ARG", help=ARGUMENTS_HELP)
    rl_parser.set_defaults(handler=_train)
    check_parser = commands.add_parser(
        "check", help="validate a run's configuration for a world size, and what it reads "
        "(data files, tokenizer, checkpoint, prompt lengths; a vLLM engine's venv), without "
        "starting it: exit 0, or 2 with the error"
    )
    check_parser.add_argument("--world-size", type=int, required=True,
                              help="processes the run will have (nodes x processes per node)")
    check_parser.add_argument("run_command", choices=("train", "sft", "rl"))
    check_parser.add_argument("arguments", nargs="+", metavar="ARG", help=ARGUMENTS_HELP)
    check_parser.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    _configure_logging()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
