"""The GPU presets' generated memory blocks and README's presets table are what the estimator
says now (tools/preset_verdicts.py): after a change of the estimator, ``--write`` updates
them and this test keeps them from going stale."""

from __future__ import annotations

import pytest

from tests.tools import load_tool
from tests.torchrun import REPO


def _tool():
    return load_tool("preset_verdicts")


def test_preset_headers_and_readme_table_equal_what_the_estimator_says_now():
    tool = _tool()
    expected = tool.expected_files()
    assert sorted(p.name for p in expected) == sorted(
        [*(f"{name}.yaml" for name in (*tool.PRESETS, *tool.MOE_PRESETS)), "README.md",
         "context_parallel.md"])
    stale = [path.name for path, text in expected.items() if path.read_text() != text]
    assert not stale, f"{stale}: run python tools/preset_verdicts.py --write"


def test_each_preset_block_marks_the_master_store_the_preset_configures():
    tool = _tool()
    for name in tool.PRESETS:
        block = tool.current_block((REPO / "configs" / f"{name}.yaml").read_text(),
                                   tool.BEGIN, tool.END)
        assert block is not None, name
        chosen = tool._chosen_master_mode(tool._config(name))
        (marked,) = [line for line in block.splitlines() if "<- this preset" in line]
        assert f"LoGRA {chosen} " in marked, (name, marked)


def test_the_moe_preset_block_says_lora_is_refused_and_compares_one_node_with_two():
    tool = _tool()
    for name in tool.MOE_PRESETS:
        block = tool.current_block((REPO / "configs" / f"{name}.yaml").read_text(),
                                   tool.BEGIN, tool.END)
        assert block is not None, name
        assert "LoRA refused" in block and "LoRA is refused for MoE by the trainer" in block
        assert f"{tool.TWO_NODES} GPUs (2 nodes)" in block
        assert "LoGRA fp32 (as configured)" in block, block


def test_a_file_without_the_markers_is_refused_naming_the_fix():
    tool = _tool()
    with pytest.raises(ValueError, match="add the two marker lines"):
        tool._replace_block("model: {}\n", tool.BEGIN, tool.END, "block", "x.yaml")
