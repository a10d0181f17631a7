"""Convert Qwen2 / Llama checkpoints between Hugging Face (safetensors) and Megatron.

    python tools/convert_hf.py to-megatron HF_DIR OUT_DIR [parallel.tp=N parallel.pp=M]
                               [model.seq_length=L] [model.params_dtype=bf16|fp32]
                               [model.make_vocab_size_divisible_by=K]
    python tools/convert_hf.py to-hf MEGATRON_DIR OUT_DIR [--hf-config PATH]
                               [--max-shard-bytes N]

``to-megatron`` writes OUT_DIR/model (a model-only checkpoint that loads at any TP/PP layout),
OUT_DIR/model.yaml (the ``model:`` section the checkpoint dictates; its init_checkpoint points at
OUT_DIR/model), OUT_DIR/tokenizer (the tokenizer files and the model's generation_config.json)
and OUT_DIR/hf_source.json (what ``to-hf`` needs to write the original files back). ``parallel.tp`` / ``parallel.pp`` choose the layout the
checkpoint is written at (each rank reads only the tensors of its own stage); with tp * pp > 1
the tool starts itself under torchrun with tp * pp CPU processes. The parameters keep the Hugging
Face dtype (bf16 stays bf16; fp16 becomes fp32, which holds it exactly); training must use the
same model.params_dtype, or convert with the override.

``to-hf`` reads a converted directory, or any checkpoint directory (model-only, e.g. an sft or
rl run's <run.dir>/model, or a training checkpoint's iter_NNNNNNN), and writes config.json,
generation_config.json, safetensors and the tokenizer files that ``transformers`` loads. A
trained run's checkpoint takes config.json (positions, EOS) and the generation config from the
converted directory its chain of ``model.init_checkpoint`` started from, and the tokenizer the
run encoded its data with (``data.tokenizer``); with neither, ``--hf-config`` names the
config.json (or a directory holding it) to write, else a Qwen2 or Llama config.json is derived
(EOS and the generation config's stop tokens from the run's tokenizer).

A run starts from a converted model with OUT_DIR/model.yaml after its preset (``megatron-logra rl
configs/PRESET.yaml OUT_DIR/model.yaml ...``: the architecture, init_checkpoint and vocab_size
come from it, the run's seq_length, attention and recompute from the preset), at any layout;
``data.tokenizer=OUT_DIR/tokenizer`` encodes the prompt data with the model's tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Overrides to-megatron accepts: the layout it writes at, and model settings that do not change
# the weights. Everything else in the model section is dictated by config.json.
ALLOWED_OVERRIDES = (
    "parallel.tp", "parallel.pp", "model.seq_length", "model.params_dtype",
    "model.make_vocab_size_divisible_by",
)
# Model settings a run chooses, not the checkpoint: left out of model.yaml (unless given as an
# override here), so that a preset before it keeps its own.
RUN_MODEL_FIELDS = ("seq_length", "attention", "recompute", "recompute_method",
                    "recompute_num_layers", "init_method_std", "moe_token_dispatcher")


def _refuse_non_empty(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {str(out_dir)!r} exists and is not empty; choose a new "
                         "directory or remove it")


# ----------------------------------------------------------------------------- to-megatron


def _parse_overrides(overrides: list[str]) -> list[tuple[str, str, Any]]:
    from megatron_logra.config import parse_override

    parsed = []
    for text in overrides:
        parts, value = parse_override(text)
        if ".".join(parts) not in ALLOWED_OVERRIDES:
            raise ValueError(f"override {text!r} is not accepted by to-megatron; allowed: "
                             f"{list(ALLOWED_OVERRIDES)} (the rest follows from config.json)")
        section, key = parts  # every allowed override is section.key
        parsed.append((section, key, value))
    return parsed


def _to_megatron_config(hf_dir: Path, out_dir: Path, overrides: list[str]) -> tuple[Any, Any]:
    """The run config the checkpoint is written with, and the Hugging Face architecture."""
    from megatron_logra.config import config_from_dict
    from megatron_logra.mcore.conversion import (
        CHECKPOINT_NAME,
        HF_CONFIG_FILE,
        TOKENIZER_FILES,
        SafetensorsReader,
        architecture_from_hf_config,
        model_config_from_hf,
        params_dtype_for,
    )

    config_path = hf_dir / HF_CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{str(hf_dir)!r} has no {HF_CONFIG_FILE}; point at a Hugging Face model "
                         "directory")
    arch = architecture_from_hf_config(json.loads(config_path.read_text()))
    if any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        _check_tokenizer_fits(hf_dir, arch.vocab_size)
    reader = SafetensorsReader(hf_dir)
    model = model_config_from_hf(arch, params_dtype=params_dtype_for(reader.dtype()))
    data: dict[str, dict[str, Any]] = {
        "model": dataclasses.asdict(model),
        "parallel": {"device": "cpu"},
        # One sequence per rank: the batch plays no part in a conversion.
        "train": {"micro_batch_size": 1, "global_batch_size": 1},
    }
    data["model"]["init_checkpoint"] = str((out_dir / CHECKPOINT_NAME).resolve())
    for section, key, value in _parse_overrides(overrides):
        data.setdefault(section, {})[key] = value
    cfg = config_from_dict(data)
    cfg.validate()
    return cfg, arch


def to_megatron(hf_dir: Path, out_dir: Path, overrides: list[str]) -> int:
    # Refuse a bad override before the slow imports of Megatron and transformers.
    _parse_overrides(overrides)
    cfg, arch = _to_megatron_config(hf_dir, out_dir, overrides)
    _refuse_non_empty(out_dir)
    layout_procs = cfg.parallel.tp * cfg.parallel.pp
    if layout_procs > 1 and "WORLD_SIZE" not in os.environ:
        # Each rank of the layout builds and writes its own shards.
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={layout_procs}", str(Path(__file__).resolve()),
                   "to-megatron", str(hf_dir), str(out_dir), *overrides]
        print("convert_hf: running " + " ".join(command), flush=True)
        return subprocess.run(command, check=False).returncode
    overridden = {key for section, key, _ in _parse_overrides(overrides) if section == "model"}
    return _to_megatron_ranks(cfg, arch, hf_dir, out_dir, overridden)


def _to_megatron_ranks(cfg: Any, arch: Any, hf_dir: Path, out_dir: Path,
                       overridden: set[str]) -> int:
    from megatron_logra.mcore.checkpointing.checkpoint import save_model_checkpoint
    from megatron_logra.mcore.conversion import (
        CHECKPOINT_NAME,
        SafetensorsReader,
        check_hf_names,
        check_tied_head,
        load_hf_weights_,
    )
    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.process_groups import (
        destroy_parallel,
        init_parallel,
        world_size_from_env,
    )

    reader = SafetensorsReader(hf_dir)
    check_hf_names(reader.names(), arch)
    check_tied_head(reader, arch)
    hf_dtype = reader.dtype()
    resolved = cfg.resolved(world_size_from_env())
    groups = init_parallel(resolved)
    try:
        chunks = build_model_chunks(resolved, groups, vocab_size=arch.vocab_size)
        load_hf_weights_(chunks, reader, arch, resolved.model, groups)
        save_model_checkpoint(out_dir, model_chunks=chunks, cfg=resolved, groups=groups,
                              name=CHECKPOINT_NAME)
    finally:
        destroy_parallel()
    if int(os.environ.get("RANK", "0")) == 0:
        _write_side_files(hf_dir, out_dir, arch, resolved, hf_dtype, overridden)
    return 0


def _write_side_files(hf_dir: Path, out_dir: Path, arch: Any, resolved: Any, hf_dtype: Any,
                      overridden: set[str]) -> None:
    """Next to the checkpoint: the model section to run it with, what the Hugging Face source
    was (for the way back), and the tokenizer."""
    import yaml

    from megatron_logra.mcore.conversion import (
        CHECKPOINT_NAME,
        HF_CONFIG_FILE,
        HF_GENERATION_CONFIG_FILE,
        HF_SOURCE_FILE,
        MODEL_YAML,
        TOKENIZER_DIR,
        TOKENIZER_FILES,
    )

    model_section = {key: value for key, value in dataclasses.asdict(resolved.model).items()
                     if key not in RUN_MODEL_FIELDS or key in overridden}
    # The checkpoint's embedding rows, which may exceed the tokenizer's ids: a run with this
    # model section builds the same padded embedding whatever tokenizer it encodes text with.
    model_section["vocab_size"] = arch.vocab_size
    header = (
        f"# Converted from {hf_dir.name} ({arch.model_type}); Hugging Face vocabulary "
        f"{arch.vocab_size} rows.\n"
        "# The model section this checkpoint dictates (init_checkpoint loads it at any layout); "
        "give it after a preset,\n"
        f"# which keeps its {', '.join(sorted(RUN_MODEL_FIELDS))}:\n"
        f"#   megatron-logra rl configs/PRESET.yaml {out_dir / MODEL_YAML} "
        f"data.tokenizer={out_dir / TOKENIZER_DIR} data.dir=...\n"
    )
    (out_dir / MODEL_YAML).write_text(
        header + yaml.safe_dump({"model": model_section}, sort_keys=False)
    )
    generation = hf_dir / HF_GENERATION_CONFIG_FILE
    source = {
        "config": json.loads((hf_dir / HF_CONFIG_FILE).read_text()),
        "generation_config": json.loads(generation.read_text()) if generation.is_file() else None,
        "dtype": str(hf_dtype).removeprefix("torch."),
    }
    (out_dir / HF_SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    copied = [name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    if copied:
        (out_dir / TOKENIZER_DIR).mkdir()
        # The generation config beside the tokenizer: its eos_token_id list (Qwen's <|im_end|>
        # and <|endoftext|>) is where the model's generations stop (data.tokenizer reads it).
        for name in [*copied, *([HF_GENERATION_CONFIG_FILE] if generation.is_file() else [])]:
            shutil.copy2(hf_dir / name, out_dir / TOKENIZER_DIR / name)
    else:
        print(f"convert_hf: warning: {hf_dir} holds no tokenizer files; none copied",
              file=sys.stderr)
    print(f"convert_hf: wrote {out_dir / CHECKPOINT_NAME} (tp={resolved.parallel.tp}, "
          f"pp={resolved.parallel.pp}, {resolved.model.params_dtype}), {out_dir / MODEL_YAML}; "
          f"run it with: megatron-logra rl configs/PRESET.yaml {out_dir / MODEL_YAML} "
          f"data.tokenizer={out_dir / TOKENIZER_DIR} data.dir=DATA_DIR")


def _check_tokenizer_fits(directory: Path, vocab_size: int) -> None:
    from megatron_logra.data.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(directory)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {directory} has {tokenizer.vocab_size} ids but the "
                         f"model's embedding only {vocab_size} rows")


# ----------------------------------------------------------------------------- to-hf


def _checkpoint_and_root(megatron_dir: Path) -> tuple[Path, Path | None]:
    from megatron_logra.mcore.conversion import CHECKPOINT_NAME

    if (megatron_dir / "metadata.json").is_file():
        return megatron_dir, None
    if (megatron_dir / CHECKPOINT_NAME / "metadata.json").is_file():
        return megatron_dir / CHECKPOINT_NAME, megatron_dir
    raise ValueError(f"{str(megatron_dir)!r} is neither a checkpoint directory nor a directory "
                     "written by to-megatron")


def _converted_root(checkpoint: Path, common: dict[str, Any]) -> Path | None:
    """The to-megatron directory a checkpoint descends from: model.init_checkpoint of the run
    that wrote it, of that checkpoint's run, ... up to the one whose parent holds
    hf_source.json (None when the chain ends elsewhere or a link is gone)."""
    from megatron_logra.mcore.conversion import HF_SOURCE_FILE, read_common_state

    seen: set[Path] = {checkpoint.resolve()}
    init = common["config"]["model"].get("init_checkpoint")
    while init:
        path = Path(init).resolve()
        # A converted checkpoint names itself (the conversion's own config): no run descends
        # from anything there.
        if path in seen or not (path / "metadata.json").is_file():
            return None
        seen.add(path)
        if (path.parent / HF_SOURCE_FILE).is_file():
            return path.parent
        init = read_common_state(path)["config"]["model"].get("init_checkpoint")
    return None


def _tokenizer_dir(root: Path | None, common: dict[str, Any]) -> Path | None:
    """The tokenizer the run encoded its data with (data.tokenizer), else the conversion's."""
    from megatron_logra.mcore.conversion import TOKENIZER_DIR

    used = common["config"].get("data", {}).get("tokenizer")
    if used and Path(used).is_dir():
        return Path(used)
    if root is not None and (root / TOKENIZER_DIR).is_dir():
        return root / TOKENIZER_DIR
    return None


def _stop_ids(tokenizer_dir: Path, common: dict[str, Any]) -> list[int]:
    """The stop tokens the run generated with (EOS, generation config, the chat template's end
    of turn when data.prompt.chat_template was on)."""
    from megatron_logra.config import PromptConfig
    from megatron_logra.data.hf_tokenizer import HFTokenizer
    from megatron_logra.data.prompt_builder import PromptBuilder

    prompt = common["config"].get("data", {}).get("prompt") or {}
    return list(PromptBuilder(HFTokenizer(tokenizer_dir), PromptConfig(**prompt)).stop_ids)


def _source(
    root: Path | None, hf_config: Path | None, model: Any, weights: dict[str, Any]
) -> dict[str, Any]:
    """config.json (and generation config) to write, and the dtype of the tensors."""
    import torch

    from megatron_logra.mcore.conversion import (
        HF_CONFIG_FILE,
        HF_SOURCE_FILE,
        hf_config_from_model_config,
    )

    stored = {t.dtype for t in weights.values()}
    if len(stored) != 1:
        raise RuntimeError(f"checkpoint mixes dtypes {sorted(map(str, stored))}")
    stored_dtype = stored.pop()
    if hf_config is not None:
        path = hf_config / HF_CONFIG_FILE if hf_config.is_dir() else hf_config
        if not path.is_file():
            raise ValueError(f"--hf-config {str(hf_config)!r} is not a config.json (or a directory "
                             "holding one)")
        config = json.loads(path.read_text())
        name = config.get("dtype") or config.get("torch_dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) else stored_dtype
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path} has dtype {name!r}, not a torch dtype name such as "
                             "'bfloat16'; fix the config.json")
        return {"config": config, "generation_config": None, "dtype": dtype}
    if root is not None and (root / HF_SOURCE_FILE).is_file():
        source = json.loads((root / HF_SOURCE_FILE).read_text())
        return {**source, "dtype": getattr(torch, source["dtype"])}
    vocab = weights["embedding.word_embeddings.weight"].shape[0]
    return {"config": hf_config_from_model_config(model, vocab_size=vocab, dtype=stored_dtype),
            "generation_config": None, "dtype": stored_dtype}


def to_hf(megatron_dir: Path, out_dir: Path, hf_config: Path | None, max_shard_bytes: int) -> int:
    from megatron_logra.config import config_from_dict, load_config
    from megatron_logra.mcore.checkpointing.checkpoint import verify_checkpoint
    from megatron_logra.mcore.conversion import (
        HF_CONFIG_FILE,
        HF_GENERATION_CONFIG_FILE,
        HF_SOURCE_FILE,
        TOKENIZER_FILES,
        architecture_from_hf_config,
        check_model_config_matches,
        checkpoint_full_weights,
        hf_tensors_from_megatron,
        read_common_state,
        write_safetensors,
    )
    from megatron_logra.mcore.process_groups import destroy_parallel, init_parallel

    _refuse_non_empty(out_dir)
    checkpoint, root = _checkpoint_and_root(megatron_dir)
    # dist_checkpointing reads through torch.distributed: a world of one CPU process.
    groups = init_parallel(load_config(None, ["parallel.device=cpu"]).resolved(1))
    try:
        verify_checkpoint(checkpoint, groups)
        common = read_common_state(checkpoint)
        model = config_from_dict({"model": common["config"]["model"]}).model
        weights = checkpoint_full_weights(checkpoint, model)
        if root is None or not (root / HF_SOURCE_FILE).is_file():
            # A trained run's model: its config.json, generation config and positions are
            # those of the Hugging Face model its chain of init_checkpoints started from.
            root = _converted_root(checkpoint, common) or root
    finally:
        destroy_parallel()
    source = _source(root, hf_config, model, weights)
    derived = hf_config is None and (root is None or not (root / HF_SOURCE_FILE).is_file())
    tokenizer_dir = _tokenizer_dir(root, common)
    if tokenizer_dir is not None:
        if derived:
            # No source config to keep: EOS and the generation config's stop tokens are the
            # ones the run generated with.
            stops = _stop_ids(tokenizer_dir, common)
            source["config"]["eos_token_id"] = stops[0] if len(stops) == 1 else stops
            source["generation_config"] = {"eos_token_id": source["config"]["eos_token_id"]}
    else:
        print("convert_hf: warning: no tokenizer found (neither the run's data.tokenizer nor a "
              "converted directory's tokenizer/); the output has no tokenizer files and no EOS",
              file=sys.stderr)
    arch = architecture_from_hf_config(source["config"])
    check_model_config_matches(model, arch)
    tensors = {name: tensor.to(source["dtype"])
               for name, tensor in hf_tensors_from_megatron(weights, arch).items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        files = write_safetensors(tensors, staging, max_shard_bytes)
        (staging / HF_CONFIG_FILE).write_text(json.dumps(source["config"], indent=2) + "\n")
        if source["generation_config"] is not None:
            (staging / HF_GENERATION_CONFIG_FILE).write_text(
                json.dumps(source["generation_config"], indent=2) + "\n")
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copy2(tokenizer_dir / name, staging / name)
        staging.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked above
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"convert_hf: wrote {out_dir} ({arch.model_type}, {len(tensors)} tensors in "
          f"{len(files)} file(s), {str(source['dtype']).removeprefix('torch.')})")
    return 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to_mg = commands.add_parser("to-megatron", help="Hugging Face -> Megatron checkpoint")
    to_mg.add_argument("hf_dir", type=Path)
    to_mg.add_argument("out_dir", type=Path)
    to_mg.add_argument("overrides", nargs="*", help=f"any of {list(ALLOWED_OVERRIDES)}")
    to_h = commands.add_parser("to-hf", help="Megatron checkpoint -> Hugging Face")
    to_h.add_argument("megatron_dir", type=Path)
    to_h.add_argument("out_dir", type=Path)
    to_h.add_argument("--hf-config", type=Path, help="config.json (or its directory) to write")
    to_h.add_argument("--max-shard-bytes", type=int, default=None,
                      help="split the safetensors into shards of at most this many bytes "
                           "(default 5 GiB)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        if args.command == "to-megatron":
            return to_megatron(args.hf_dir, args.out_dir, args.overrides)
        from megatron_logra.mcore.conversion import DEFAULT_MAX_SHARD_BYTES

        return to_hf(args.megatron_dir, args.out_dir, args.hf_config,
                     args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    except ValueError as error:
        print(f"convert_hf: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
