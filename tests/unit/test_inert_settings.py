"""Settings that were accepted and did nothing (issue 21 item 7): the KL controller's settings
with the control off are refused; ``logra.merge_chunk_mib`` bounds the host merge's chunks (whole
192-row groups, never more than the budget) and a budget below one group is refused. The
separate engine's settings with colocated rollouts: tests/unit/test_rollout_placement.py."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_logra.config import load_config
from megatron_logra.master_weights import master_weights_mode
from megatron_logra.merge_chunks import MERGE_ROW_ALIGNMENT, MIB, host_chunk_rows
from megatron_logra.row_sharding import RowShard

LOGRA = ["optimizer.name=logra"]
HOST = ["model.params_dtype=bf16", "optimizer.name=logra", "logra.master_weights=host"]


def _refused(overrides: list[str], fragments: list[str], command: str = "train") -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, overrides, command=command).resolved(1, command)
    for fragment in fragments:
        assert re.search(re.escape(fragment), str(info.value)), (fragment, str(info.value))


@pytest.mark.parametrize("override", [
    "logra.kl_control.kl_budget=1e-3", "logra.kl_control.schedule_steps=50",
    "logra.kl_control.probe_responses=4", "logra.kl_control.mismatch_subtraction=false",
    "logra.kl_control.mismatch_input=1e-3",
])
def test_a_kl_control_setting_with_the_control_off_is_refused(override):
    key, value = override.split("=")
    _refused([*LOGRA, override], [key, "logra.kl_control.enabled=false",
                                  "logra.kl_control.enabled=true or drop"])
    # With the control on it acts (and is accepted); a dense optimizer's run leaves the whole
    # logra section unselected, as the other loss preset's settings are.
    load_config(None, [*LOGRA, "logra.kl_control.enabled=true", override]).resolved(1)
    load_config(None, ["optimizer.name=adam", override]).resolved(1)


def test_an_explicit_kl_temperature_with_the_control_off_is_refused_in_supervised_runs():
    _refused([*LOGRA, "logra.kl_control.temperature=0.5"],
             ["logra.kl_control.temperature=0.5", "enabled=false"])


def test_the_chunk_is_the_most_whole_row_groups_within_the_budget():
    width = 18944  # Qwen2.5-7B's FFN: one group of 192 fp32 rows is 13.9 MiB
    assert host_chunk_rows(int(64 * MIB), width) == 4 * MERGE_ROW_ALIGNMENT
    assert host_chunk_rows(int(13.8 * MIB), width) == 0
    for budget_mib in (14, 32, 64, 100):
        rows = host_chunk_rows(int(budget_mib * MIB), width)
        assert rows % MERGE_ROW_ALIGNMENT == 0
        assert rows * width * 4 <= budget_mib * MIB < (rows + MERGE_ROW_ALIGNMENT) * width * 4


def test_a_host_chunk_never_exceeds_merge_chunk_mib():
    """Before, a 1 MiB budget gave chunks of one whole group, 13.9 MiB at width 18944 (and a
    store built with it still refuses, naming the budget it needs)."""
    shard = RowShard(2 * MERGE_ROW_ALIGNMENT, stride=1, dp_size=1, dp_rank=0)
    weight = torch.empty(shard.rows, 18944, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="merge_chunk_mib=1 holds no group of 192 fp32 rows"):
        master_weights_mode("host", torch.bfloat16, merge_chunk_mib=1.0).make(weight, shard)


@pytest.mark.parametrize(("overrides", "target", "width"), [
    ([], "linear_fc2", 18944),  # row-parallel fc2 at TP=1: the whole FFN
    (["parallel.tp=2"], "linear_fc2", 9472),  # its slice at TP=2
    (["logra.targets=[linear_qkv,linear_proj]"], "linear_qkv", 3584),
])
def test_a_budget_below_one_group_of_the_widest_target_is_refused_before_any_rank_starts(
        overrides, target, width):
    model = ["model.hidden_size=3584", "model.num_attention_heads=28",
             "model.ffn_hidden_size=18944", "model.seq_length=128"]
    needed = 4 * width * MERGE_ROW_ALIGNMENT / MIB
    cfg = [*HOST, *model, *overrides]
    world = 2 if "parallel.tp=2" in overrides else 1
    with pytest.raises(ValueError) as info:
        load_config(None, [*cfg, f"logra.merge_chunk_mib={needed * 0.99}"]).resolved(world)
    assert f"of {target} ({width} input columns" in str(info.value)
    assert f"logra.merge_chunk_mib >= {needed:.4g}" in str(info.value)
    load_config(None, [*cfg, f"logra.merge_chunk_mib={needed}"]).resolved(world)
