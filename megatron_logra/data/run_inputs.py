"""What a run reads from disk, checked before any rank starts (``megatron-logra check`` and the
CLI itself): the dataset's files, the tokenizer, ``model.init_checkpoint``, and that every
problem fits ``model.seq_length`` -- a prompt with ``rl.sampling.max_new_tokens`` for ``rl``, a
whole supervised sample for ``sft``. Each refusal names the field, what was found and the fix
(``tools/convert_hf.py`` for a Hugging Face directory); the notes are things a run would do that
a user may not expect (a chat template left unused).
"""

from __future__ import annotations

from pathlib import Path

from megatron_logra.checkpoint_files import MANIFEST
from megatron_logra.config import Config
from megatron_logra.data.dataset_dir import TOKENS_FILE
from megatron_logra.data.problem_files import load_split
from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.data.run_tokenizer import load_prompt_builder

HF_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def check_checkpoint_path(key: str, value: str) -> None:
    path = Path(value)
    if not path.is_dir():
        raise ValueError(f"{key}={value!r} does not exist; point it at a checkpoint directory")
    if (path / MANIFEST).is_file():
        return
    if (path / HF_MODEL_FILES[0]).is_file() and any(
            (path / name).is_file() for name in HF_MODEL_FILES[1:]):
        raise ValueError(
            f"{key}={value!r} is a Hugging Face model directory, not a Megatron checkpoint; "
            f"convert it first: python tools/convert_hf.py to-megatron {value} OUT_DIR, then run "
            "with OUT_DIR/model.yaml after the preset (its model section, init_checkpoint "
            "included) and data.tokenizer=OUT_DIR/tokenizer"
        )
    if (path / "model" / MANIFEST).is_file():
        raise ValueError(f"{key}={value!r} holds a checkpoint in its model/ directory; set "
                         f"{key}={path / 'model'}")
    raise ValueError(
        f"{key}={value!r} is not a complete checkpoint (no {MANIFEST}); give OUT_DIR/model of "
        "tools/convert_hf.py to-megatron, <run.dir>/model of an sft or rl run, or a checkpoint "
        "directory iter_NNNNNNN"
    )


def _longest(problems: list[PromptProblem], lengths: list[int], limit: int, what: str,
             fix: str) -> None:
    over = [i for i, n in enumerate(lengths) if n > limit]
    if over:
        worst = max(over, key=lengths.__getitem__)
        raise ValueError(
            f"{len(over)} of {len(problems)} {what} do not fit: {problems[worst].origin} takes "
            f"{lengths[worst]} tokens, more than {limit}; {fix}"
        )


def check_run_inputs(cfg: Config, command: str) -> list[str]:
    """ValueError for the first input the run could not use; returns notes to show the user."""
    notes: list[str] = []
    if cfg.model.init_checkpoint and not cfg.checkpoint.resume:
        check_checkpoint_path("model.init_checkpoint", cfg.model.init_checkpoint)
    data = cfg.data
    if data.format == "corpus":
        if not (Path(data.dir) / TOKENS_FILE).is_file():
            raise ValueError(f"data.dir={data.dir!r} has no {TOKENS_FILE} for language modelling "
                             f"(data.format=corpus); write it with `python "
                             f"tools/make_synthetic_data.py --out {data.dir}`")
        load_prompt_builder(cfg)
        return notes
    builder = load_prompt_builder(cfg)
    if getattr(builder.tokenizer, "has_chat_template", False) and not data.prompt.chat_template:
        notes.append(
            f"the tokenizer in {data.tokenizer} has a chat template and "
            "data.prompt.chat_template=false: prompts are encoded as plain text, without the "
            "template's turns or generation prompt (set data.prompt.chat_template=true for an "
            "instruction-tuned model)")
    train = load_split(data, "train")
    seq = cfg.model.seq_length
    if command == "rl":
        new = cfg.rl.sampling.max_new_tokens
        fix = (f"raise model.seq_length={seq}, lower rl.sampling.max_new_tokens={new} or "
               "shorten those prompts")
        for what, problems in (("training prompts", train),
                               ("held-out prompts", load_split(data, cfg.rl.eval.split)
                                [: cfg.rl.eval.prompts])):
            _longest(problems, [len(builder.prompt_ids(p)) + new for p in problems], seq,
                     f"{what} with rl.sampling.max_new_tokens={new}", fix)
    else:
        _longest(train, [len(builder.supervised_tokens(p)[0]) for p in train], seq + 1,
                 "supervised samples (prompt, target and stop token)",
                 f"raise model.seq_length={seq} or shorten those samples")
    return notes
