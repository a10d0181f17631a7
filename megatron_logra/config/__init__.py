"""Run configuration: small typed sections, nested per component, loaded from YAML plus
``section.key=value`` overrides.

Validation has no side effects and happens before any process group exists, so a typo costs a
second, not a cluster allocation. Every error names the field, the value and what to do. Nothing
here imports torch.

    cfg = load_config("configs/demo_cpu.yaml", ["parallel.tp=2", "optimizer.name=logra"])
    cfg = cfg.resolved(world_size=2)   # fills parallel.dp and checks the layout

Sections: ``model`` and ``parallel`` (config/model.py); ``optimizer``, ``logra`` with
``logra.kl_control``, ``lora`` (config/optim.py); ``rl`` with ``sampling``, ``loss``,
``advantages``, ``reward`` (and ``reward.math_verify``), ``eval`` (config/rl.py) and
``loss.correction`` (config/off_policy.py); ``rollout`` and ``sync`` (config/rollout.py); ``train``,
``run``, ``checkpoint`` (config/run.py), with ``train.packing`` (config/packing.py); ``data`` with
``data.prompt`` (config/data.py). The names of every choice (targets, direction
rules, distributions, rewards, ...) are declared here once; the implementing modules map them.
"""

from megatron_logra.config.data import (
    DATA_FORMATS,
    PROBLEM_FILE_SUFFIXES,
    SPLIT_CANDIDATES,
    DataConfig,
    PromptConfig,
)
from megatron_logra.config.loader import check_key, config_from_dict, load_config, parse_override
from megatron_logra.config.model import (
    ACTIVATIONS,
    ATTENTIONS,
    DEVICES,
    NORMALIZATIONS,
    PARAMS_DTYPES,
    POSITION_EMBEDDINGS,
    RECOMPUTE_METHODS,
    RECOMPUTES,
    ModelConfig,
    ParallelConfig,
)
from megatron_logra.config.off_policy import CORRECTIONS, CorrectionConfig
from megatron_logra.config.optim import (
    DIRECTIONS,
    DISTRIBUTIONS,
    LOGRA_MODES,
    LR_DECAY_STYLES,
    MASTER_WEIGHTS,
    NATIVE_OPTIMIZERS,
    OPTIMIZERS,
    TARGET_NAMES,
    UPDATE_FACTOR_DTYPES,
    KLControlConfig,
    LoGRAConfig,
    LoRAConfig,
    OptimizerConfig,
)
from megatron_logra.config.packing import PACKING_ALGORITHMS, PackingConfig
from megatron_logra.config.rl import (
    EVAL_SPLITS,
    FAILURE_POLICIES,
    REWARDS,
    RL_LOSSES,
    START_METHODS,
    AdvantagesConfig,
    EvalConfig,
    GrpoLossConfig,
    LossConfig,
    MathVerifyConfig,
    PaperAdvantageConfig,
    RewardConfig,
    RLConfig,
    SamplingConfig,
)
from megatron_logra.config.rollout import (
    ENGINES,
    PLACEMENTS,
    SYNC_MODES,
    SYNC_TRANSPORTS,
    SYNC_WIRE_DTYPES,
    RolloutConfig,
    SyncConfig,
)
from megatron_logra.config.root import COMMAND_DEFAULTS, COMMANDS, Config
from megatron_logra.config.run import CheckpointConfig, RunConfig, TrainConfig

__all__ = [
    "ACTIVATIONS", "ATTENTIONS", "COMMANDS", "CORRECTIONS", "COMMAND_DEFAULTS", "DATA_FORMATS", "DEVICES",
    "DIRECTIONS",
    "DISTRIBUTIONS", "FAILURE_POLICIES", "LOGRA_MODES", "LR_DECAY_STYLES", "MASTER_WEIGHTS",
    "NATIVE_OPTIMIZERS", "NORMALIZATIONS", "OPTIMIZERS", "PACKING_ALGORITHMS", "PARAMS_DTYPES", "POSITION_EMBEDDINGS",
    "EVAL_SPLITS", "ENGINES", "PLACEMENTS", "SYNC_MODES", "SYNC_TRANSPORTS", "SYNC_WIRE_DTYPES", "RECOMPUTES", "RECOMPUTE_METHODS", "REWARDS", "RL_LOSSES", "START_METHODS",
    "TARGET_NAMES", "UPDATE_FACTOR_DTYPES",
    "AdvantagesConfig", "CheckpointConfig", "Config", "DataConfig", "EvalConfig",
    "GrpoLossConfig", "KLControlConfig", "LoGRAConfig", "LoRAConfig", "LossConfig",
    "MathVerifyConfig", "ModelConfig", "OptimizerConfig", "PackingConfig", "PaperAdvantageConfig",
    "PaperLossConfig", "CorrectionConfig", "ParallelConfig", "PROBLEM_FILE_SUFFIXES", "PromptConfig", "RLConfig", "RewardConfig", "RolloutConfig", "RunConfig", "SyncConfig",
    "SamplingConfig", "SPLIT_CANDIDATES", "TrainConfig", "check_key", "config_from_dict", "load_config",
    "parse_override",
]
