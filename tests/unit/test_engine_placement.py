"""A separate engine's GPU placement (``rollout.devices``) and its transport choice: the config
refusals, and the environment the engine's processes get (the logic that decides it runs here
without a GPU; the device count and the trainer's environment are its inputs)."""

from __future__ import annotations

import re

import pytest

from megatron_logra.config import config_from_dict, load_config
from megatron_logra.rollout.megatron_engine import engine_config
from megatron_logra.rollout.placement import engine_device_env, trainer_devices

SEPARATE = ["rollout.placement=separate", "optimizer.name=logra"]
EIGHT_GPUS = 8
TORCHRUN_4 = {"LOCAL_WORLD_SIZE": "4"}  # a 4-rank trainer on the node, CUDA_VISIBLE_DEVICES unset


def _refused(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, overrides, command="rl").resolved(1, "rl")
    for fragment in fragments:
        assert re.search(re.escape(fragment), str(info.value)), (fragment, str(info.value))


@pytest.mark.parametrize(("overrides", "fragments"), [
    ([*SEPARATE, "sync.transport=nccl"], ["sync.transport='nccl'", "rpc", "collective"]),
    ([*SEPARATE, "rollout.tp=2", "rollout.devices=[4,4]"], ["rollout.devices=[4, 4]", "distinct"]),
    ([*SEPARATE, "rollout.devices=[-1]"], ["rollout.devices=[-1]", ">= 0"]),
    ([*SEPARATE, "rollout.tp=2", "rollout.devices=[4]"],
     ["rollout.devices=[4]", "rollout.tp=2", "one device per engine rank"]),
    ([*SEPARATE, "rollout.devices=[4]", "parallel.device=cpu"],
     ["rollout.devices=[4]", "parallel.device=cpu", "drop rollout.devices"]),
    (["rollout.devices=[4]"], ["rollout.devices=[4]", "rollout.placement=colocated"]),
    (["sync.transport=collective"], ["sync.transport=collective", "rollout.placement=colocated"]),
])
def test_bad_placement_and_transport_values_are_refused_naming_field_value_and_fix(
        overrides, fragments):
    _refused(overrides, fragments)


def test_the_papers_4_plus_4_split_places_the_engine_on_its_own_devices_with_an_nccl_world():
    cfg = load_config(None, [*SEPARATE, "rollout.tp=4", "rollout.devices=[4,5,6,7]",
                             "parallel.device=cuda", "sync.transport=collective"],
                      command="rl").resolved(4, "rl")
    env = engine_device_env(cfg.rollout.devices, cuda_device_count=EIGHT_GPUS,
                            environ=TORCHRUN_4)
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # engine rank r -> visible device r
    engine = engine_config(cfg)
    assert engine["parallel"]["device"] == "cuda"  # its own world over NCCL
    # The engine's own config is a valid colocated one (its processes load it and refuse
    # anything else): no devices or transport of its own.
    assert (engine["rollout"]["devices"], engine["sync"]["transport"]) == ([], "rpc")
    config_from_dict(engine).resolved(4, "rl")
    # Without rollout.devices nothing changes: the engine follows parallel.device.
    assert engine_device_env([], cuda_device_count=0, environ={}) == {}
    plain = load_config(None, SEPARATE, command="rl").resolved(1, "rl")
    assert engine_config(plain)["parallel"]["device"] == plain.parallel.device


def test_trainer_devices_follow_its_local_ranks_and_its_visible_devices():
    assert trainer_devices({}) == [0]
    assert trainer_devices(TORCHRUN_4) == [0, 1, 2, 3]
    assert trainer_devices({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6,7,0"}) == [6, 7]
    with pytest.raises(ValueError, match="as device indices"):
        trainer_devices({"CUDA_VISIBLE_DEVICES": "GPU-1234"})


@pytest.mark.parametrize(("devices", "count", "environ", "fragments"), [
    ([4], 0, {}, ["needs CUDA devices", "this machine has none"]),
    ([8], EIGHT_GPUS, {}, ["names device 8", "has 8 (0-7)"]),
    ([2, 3, 4, 5], EIGHT_GPUS, TORCHRUN_4, ["overlaps the trainer's devices [0, 1, 2, 3]",
                                            "at [2, 3]"]),
    ([6], EIGHT_GPUS, {"CUDA_VISIBLE_DEVICES": "6,7"}, ["overlaps", "[6]"]),
])
def test_engine_devices_without_cuda_out_of_range_or_shared_with_the_trainer_are_refused(
        devices, count, environ, fragments):
    with pytest.raises(ValueError) as info:
        engine_device_env(devices, cuda_device_count=count, environ=environ)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
