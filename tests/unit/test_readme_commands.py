"""README's training commands resolve as written: each `megatron_logra {train,sft,rl}` command
and launch-script command of its code blocks loads its config files and overrides and resolves
for its world size and command (a converted model's model.yaml, which only the converter
writes, is stood in for by the preset's own model section)."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from megatron_logra.config import load_config
from tests.torchrun import REPO

COMMANDS = ("train", "sft", "rl")
# GPUs per node the README's multi-node line assumes (its presets are for 8-GPU nodes).
GPUS_PER_NODE = 8
# Fields a converted model.yaml holds besides the architecture (tools/convert_hf.py).
CONVERTED = {"init_checkpoint": "ckpt/model"}


def _readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if any(w in COMMANDS for w in words) and (
                    "megatron_logra" in words or any(w.startswith("launch/") for w in words)):
                commands.append(words)
    return commands


def _world(words: list[str]) -> int:
    for index, word in enumerate(words):
        if word.startswith("--nproc_per_node="):
            return int(word.split("=")[1])
        if word == "--nproc":
            return int(words[index + 1])
        if word.startswith("--nodes="):
            return int(word.split("=")[1]) * GPUS_PER_NODE
    return 1


def test_readme_has_the_commands_this_test_checks():
    assert len(_readme_commands()) >= 10


@pytest.mark.parametrize("words", _readme_commands(), ids=lambda w: " ".join(w)[:90])
def test_readme_command_resolves_for_its_world_size(words, tmp_path):
    command = next(w for w in words if w in COMMANDS)
    rest = words[words.index(command) + 1:]
    files = [w for w in rest if w.endswith(".yaml")]
    overrides = [w for w in rest if "=" in w and not w.startswith("-")]
    preset = REPO / files[0]
    paths = []
    for name in files:
        path = REPO / name
        if not path.is_file():
            # What to-megatron writes: the checkpoint's model section; here the preset's own.
            model = {**yaml.safe_load(preset.read_text())["model"], **CONVERTED}
            path = tmp_path / "model.yaml"
            path.write_text(yaml.safe_dump({"model": model}))
        paths.append(path)
    cfg = load_config(paths, overrides, command=command).resolved(_world(words), command)
    assert cfg.parallel.dp is not None
