"""The whole run configuration: its sections, the checks that span sections, and the resolution
against a command and a world size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_logra.config.context_parallel import check_cp_run, cp_sequence_multiple
from megatron_logra.config.data import DataConfig
from megatron_logra.config.model import ModelConfig, ParallelConfig
from megatron_logra.config.moe import check_moe_run
from megatron_logra.config.optim import (
    LOW_PRECISION_MASTERS,
    LoGRAConfig,
    LoRAConfig,
    OptimizerConfig,
    check_host_merge_chunk,
    check_kl_control_settings_act,
)
from megatron_logra.config.packing import resolve_packing
from megatron_logra.config.rl import RLConfig
from megatron_logra.config.rollout import (
    RolloutConfig,
    SyncConfig,
    check_engine_collective_timeout,
    colocated_inert_settings,
)
from megatron_logra.config.run import CheckpointConfig, RunConfig, TrainConfig

COMMANDS: tuple[str, ...] = ("train", "sft", "rl")
# What `sft` and `rl` mean on top of the YAML file (below the user's own overrides): prompt ->
# answer data, and the final weights written as a model-only checkpoint (<run.dir>/model): an
# RL run's model.init_checkpoint after sft, the trained policy after rl (tools/convert_hf.py
# to-hf turns it into a Hugging Face directory).
COMMAND_DEFAULTS: dict[str, tuple[str, ...]] = {
    "train": (),
    "sft": ("data.format=prompts", "run.save_model=true"),
    "rl": ("data.format=prompts", "run.save_model=true"),
}
# A supervised run samples nothing: its KL probe measures the policy at temperature 1.
SUPERVISED_KL_TEMPERATURE = 1.0


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logra: LoGRAConfig = field(default_factory=LoGRAConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    provided: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    """The dotted keys the YAML file and the overrides set. A derived setting uses it to refuse
    an explicit value that disagrees; it is not part of :meth:`to_dict`."""

    def sections(self) -> list[tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if dataclasses.is_dataclass(getattr(self, f.name))]

    def validate(self) -> None:
        for name, section in self.sections():
            section.validate(name)
        m, p = self.model, self.parallel
        for name, value in (
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_query_groups", m.query_groups),
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ):
            if value % p.tp:
                raise ValueError(
                    f"{name}={value} must be divisible by parallel.tp={p.tp}; change one of them"
                )
        self._check_low_rank_widths()
        if self.optimizer.name == "logra":
            check_host_merge_chunk(self.logra, m, p.tp)
        self._check_rollout_and_sync()
        if self.rl.loss.correction.name == "seq_mask_tis" and self.parallel.cp > 1:
            raise ValueError(
                f"rl.loss.correction.name=seq_mask_tis masks whole responses by their mean "
                f"log-ratio, and under parallel.cp={self.parallel.cp} each rank holds only part "
                "of every response; use tis or icepop, or parallel.cp=1")
        check_moe_run(self)
        check_cp_run(self)
        if self.logra.kl_control.enabled and self.optimizer.name != "logra":
            raise ValueError(
                "logra.kl_control.enabled=true controls LoGRA updates; it needs "
                "optimizer.name=logra"
            )
        check_kl_control_settings_act(self.logra.kl_control, self.optimizer.name)
        if self.logra.kl_control.enabled and m.attention == "te":
            raise ValueError(
                "logra.kl_control.enabled=true probes the model with forward-mode AD, which "
                "Transformer Engine's kernels do not support (model.attention=te); use "
                "model.attention=sdpa or disable logra.kl_control"
            )
        master = self.logra.master_weights
        if (master == "none" and m.params_dtype == "bf16") or (
                master in LOW_PRECISION_MASTERS and m.params_dtype == "fp32"):
            raise ValueError(
                f"logra.master_weights={master} does not fit model.params_dtype={m.params_dtype}: "
                "fp32 weights are their own masters (none), bf16 weights need exact masters "
                f"({', '.join(LOW_PRECISION_MASTERS)}); use logra.master_weights=auto"
            )
        stages = p.pp * (p.vpp or 1)
        if m.num_layers % stages:
            raise ValueError(
                f"model.num_layers={m.num_layers} must be divisible by parallel.pp * "
                f"parallel.vpp = {stages} (every pipeline stage holds the same number of layers)"
            )
        full = m.full_recompute
        if full is not None and full[1] > m.num_layers // stages:
            raise ValueError(
                f"model.recompute_num_layers={full[1]} exceeds the {m.num_layers // stages} layer(s) "
                f"of a pipeline stage (model.num_layers={m.num_layers} over "
                f"{stages} stages); lower it"
            )
        if p.sp and m.seq_length % p.tp:
            raise ValueError(
                f"model.seq_length={m.seq_length} must be divisible by parallel.tp={p.tp} "
                "with sequence parallelism"
            )

    def _check_rollout_and_sync(self) -> None:
        """A separate engine's own layout must fit the model, and its sync must be exact."""
        ro, s, m = self.rollout, self.sync, self.model
        if not ro.separate:
            if ro.max_staleness:
                raise ValueError(
                    f"rollout.max_staleness={ro.max_staleness} with rollout.placement=colocated: "
                    "colocated rollouts are sampled by the trainer's own ranks between its "
                    "updates, so generation cannot overlap training; set "
                    "rollout.placement=separate (an engine of its own) or rollout.max_staleness=0")
            inert = colocated_inert_settings(ro, s)
            if inert:
                raise ValueError(f"{', '.join(inert)} with rollout.placement=colocated: there "
                                 "is no separate engine to start, place or sync; set "
                                 "rollout.placement=separate or drop them")
            return
        check_engine_collective_timeout(ro, self.parallel.collective_timeout_s)
        if ro.max_staleness and self.rl.loss.correction.name == "none":
            raise ValueError(
                f"rollout.max_staleness={ro.max_staleness} trains on batches sampled by an older "
                "policy, and rl.loss.correction.name=none leaves that uncorrected: choose tis, "
                "icepop or seq_mask_tis (or auto)")
        if ro.cpus and (ro.devices or self.parallel.device != "cpu"):
            raise ValueError(f"rollout.cpus={ro.cpus} pins a CPU engine's processes; this engine "
                             "runs on CUDA (rollout.devices / parallel.device): drop rollout.cpus")
        if ro.devices and self.parallel.device == "cpu":
            raise ValueError(f"rollout.devices={ro.devices} with parallel.device=cpu: the engine "
                             "would run on GPUs, its trainer on the CPU; set parallel.device=cuda "
                             "or drop rollout.devices")
        for name, value in (
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_query_groups", m.query_groups),
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ):
            if value % ro.tp:
                raise ValueError(f"{name}={value} must be divisible by rollout.tp={ro.tp} (the "
                                 "engine's tensor-parallel size); change rollout.tp")
        if ro.engine == "vllm":
            # vLLM loads the policy as a Hugging Face (Llama / Qwen2) checkpoint: our converter
            # writes one only for the architecture those share.
            for name, value, needed in (("model.normalization", m.normalization, "RMSNorm"),
                                        ("model.activation", m.activation, "swiglu"),
                                        ("model.position_embedding", m.position_embedding,
                                         "rope")):
                if value != needed:
                    raise ValueError(
                        f"{name}={value!r} with rollout.engine=vllm: vLLM serves the policy as "
                        f"a Llama/Qwen2 checkpoint, which needs {name}={needed}; change it or "
                        "use rollout.engine=megatron")
        for key, top_p in (("rl.sampling.top_p", self.rl.sampling.top_p),
                           ("rl.eval.top_p", self.rl.eval.top_p)):
            if top_p < 1.0:
                raise ValueError(
                    f"{key}={top_p} with rollout.placement=separate: a separate engine returns "
                    "the untruncated log-probs only, not the nucleus-renormalised ones a top-p "
                    f"rollout also records; set {key}=1 or rollout.placement=colocated"
                )
        mode = s.resolved_mode(self.optimizer.name)
        if mode == "low_rank" and self.optimizer.name != "logra":
            raise ValueError(
                f"sync.mode=low_rank with optimizer.name={self.optimizer.name}: only LoGRA's "
                "updates are low rank (a factor and a projection seed); use sync.mode=full (or "
                "auto)"
            )
        if s.wire_dtype == "bf16":
            lossless = (mode == "low_rank" and self.logra.mode == "paper"
                        and self.logra.update_factor_dtype == "bf16")
            if not lossless:
                raise ValueError(
                    f"sync.wire_dtype=bf16 with sync.mode={mode}, logra.mode={self.logra.mode}, "
                    f"logra.update_factor_dtype={self.logra.update_factor_dtype}: bf16 on the "
                    "wire is exact only for paper mode's bf16-rounded factors (library mode "
                    "merges fp32 factors; a full sync ships exact state in its own dtype); use "
                    "sync.wire_dtype=fp32"
                )

    def _check_low_rank_widths(self) -> None:
        """A sketch (or an adapter) wider than its layer stores more than the layer's dense
        gradient (or weight) and spans nothing more: refuse it, naming the layer."""
        widths = self.model.target_widths()
        checks = []
        if self.optimizer.name == "logra" and self.logra.distribution != "identity":
            checks = [("logra.sketch_rank", self.logra.sketch_rank, self.logra.targets, 1)]
        elif self.optimizer.name == "lora":
            checks = [("lora.lora_rank", self.lora.lora_rank, self.lora.targets, 0)]
        for key, value, targets, side in checks:
            # A sketch projects the input columns (side 1); an adapter is bounded by both sides.
            for target in targets:
                bound = widths[target][1] if side else min(widths[target])
                if value > bound:
                    raise ValueError(
                        f"{key}={value} is larger than {target}'s "
                        f"{'input width' if side else 'smaller dimension'} {bound} (from the "
                        f"model section); choose {key} <= {bound} or leave {target} out of the "
                        "targets"
                    )

    def resolved(self, world_size: int, command: str = "train") -> Config:
        """A copy for ``command`` on ``world_size`` processes: ``parallel.dp`` filled in, the
        settings ``command`` derives set (refusing explicit values that disagree), the batch
        checked."""
        self.validate()
        if command not in COMMANDS:
            raise ValueError(f"command {command!r} is not one of {list(COMMANDS)}")
        cfg = self._derive_for_rl() if command == "rl" else self._derive_for_supervised()
        p, t = cfg.parallel, cfg.train
        # A data-parallel replica: tp * cp * pp ranks (CP ranks hold the same sequences).
        model_parallel = p.tp * p.cp * p.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.cp * "
                f"parallel.pp = {model_parallel}; launch a multiple of {model_parallel} processes"
            )
        dp = world_size // model_parallel
        if p.dp is not None and p.dp != dp:
            raise ValueError(
                f"parallel.dp={p.dp} but world size {world_size} with tp={p.tp}, cp={p.cp}, "
                f"pp={p.pp} gives dp={dp}; drop parallel.dp or launch {p.dp * model_parallel} "
                "processes"
            )
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                f"train.micro_batch_size * dp = {t.micro_batch_size} * {dp}"
            )
        microbatches = t.global_batch_size // (t.micro_batch_size * dp)
        if p.vpp is not None and microbatches % p.pp:
            raise ValueError(
                f"the interleaved schedule needs the number of microbatches per step "
                f"({microbatches} = train.global_batch_size / (train.micro_batch_size * dp)) to "
                f"be a multiple of parallel.pp={p.pp}; change the batch sizes"
            )
        packing = resolve_packing(t.packing, data_format=cfg.data.format, command=command,
                                  micro_batch_size=t.micro_batch_size,
                                  seq_length=cfg.model.seq_length,
                                  row_multiple=(cp_sequence_multiple(p) if p.cp > 1
                                                else p.tp if p.sp else 1),
                                  provided=self.provided, cp=p.cp,
                                  attention=cfg.model.attention)
        resolved = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp),
                                       train=dataclasses.replace(t, packing=packing),
                                       checkpoint=cfg.checkpoint.in_run(cfg.run.dir))
        check_moe_run(resolved)  # ep against the derived data-parallel size
        return resolved

    def _derive_for_supervised(self) -> Config:
        if self.rollout.separate:
            raise ValueError(
                "rollout.placement=separate runs a rollout engine for rl; a supervised run "
                "samples nothing: drop it"
            )
        if self.rl.updates_per_rollout != 1:
            raise ValueError(
                f"rl.updates_per_rollout={self.rl.updates_per_rollout} is for rl (several "
                "optimizer steps on one batch of rollouts); a supervised step takes one: drop it"
            )
        kl = self.logra.kl_control
        if kl.temperature is not None and not kl.enabled and self.optimizer.name == "logra":
            raise ValueError(
                f"logra.kl_control.temperature={kl.temperature} with logra.kl_control.enabled="
                "false: the KL control is off, so it would do nothing; set "
                "logra.kl_control.enabled=true or drop it"
            )
        if kl.temperature is not None:
            return self
        return self._with_kl(dataclasses.replace(kl, temperature=SUPERVISED_KL_TEMPERATURE))

    def _derive_for_rl(self) -> Config:
        """RL's training batch is the step's rollouts, and its policy's temperature is the
        sampling temperature: both are derived here, once."""
        r, kl = self.rl, self.logra.kl_control
        # rl's own: a preset's rl section rides along in its train / sft runs, whose sequences
        # may be shorter.
        if r.sampling.max_new_tokens >= self.model.seq_length:
            raise ValueError(
                f"rl.sampling.max_new_tokens={r.sampling.max_new_tokens} leaves no room for a "
                f"prompt in model.seq_length={self.model.seq_length}; lower it or raise "
                "model.seq_length"
            )
        if self.parallel.vpp is not None:
            raise ValueError(
                f"parallel.vpp={self.parallel.vpp}: the rollout engine runs one model chunk per "
                "rank; RL supports pipeline parallelism without virtual stages (drop "
                "parallel.vpp)"
            )
        if "train.global_batch_size" in self.provided and \
                self.train.global_batch_size != r.global_batch:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size}: in rl the batch is the "
                f"step's rollouts, rl.prompts_per_step x rl.samples_per_prompt = "
                f"{r.prompts_per_step} x {r.samples_per_prompt} = {r.global_batch}; drop "
                "train.global_batch_size or change rl.prompts_per_step"
            )
        temperature = r.sampling.temperature
        if kl.temperature is not None and kl.temperature != temperature:
            raise ValueError(
                f"logra.kl_control.temperature={kl.temperature} differs from "
                f"rl.sampling.temperature={temperature}: in rl the controlled policy is the "
                "sampling one; drop logra.kl_control.temperature"
            )
        if kl.mismatch_input is not None:
            raise ValueError(
                f"logra.kl_control.mismatch_input={kl.mismatch_input} is for supervised runs; "
                "rl measures the rollout/trainer gap itself: drop it"
            )
        cfg = self._with_kl(dataclasses.replace(kl, temperature=temperature))
        correction = dataclasses.replace(r.loss.correction, name=r.loss.correction.resolved_name(
            r.loss.name, self.rollout.max_staleness))
        return dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, global_batch_size=r.global_batch),
            rl=dataclasses.replace(r, loss=dataclasses.replace(r.loss, correction=correction)),
        )

    def _with_kl(self, kl: Any) -> Config:
        return dataclasses.replace(self, logra=dataclasses.replace(self.logra, kl_control=kl))

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the whole run (the LR schedule's length): ``train.steps`` times
        ``rl.updates_per_rollout`` (1 outside rl, where another value is refused)."""
        return self.train.steps * self.rl.updates_per_rollout

    @property
    def num_microbatches(self) -> int:
        if self.parallel.dp is None:
            raise RuntimeError("num_microbatches needs a resolved config (call resolved())")
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(section) for name, section in self.sections()}
