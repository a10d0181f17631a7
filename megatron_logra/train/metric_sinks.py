"""Optional mirrors of the per-step metrics records: TensorBoard and Weights & Biases.

A sink receives exactly the records that go to ``metrics.jsonl`` and forwards their numeric
fields, at the record's ``step``. Like the metrics log, only rank 0 should own one::

    sinks = [TensorBoardSink("runs/x/tensorboard"),
             WandbSink(project="logra", run_name="x", mode="offline", dir="runs/x")]
    for sink in sinks:
        sink.log({"step": 1, "loss": 4.2, "lr": 1e-3})
    for sink in sinks:
        sink.close()

tensorboard and wandb are optional packages: each is imported when its sink is created, so the
core package never needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megatron_logra.config import Config

WANDB_MODES: tuple[str, ...] = ("offline", "online", "disabled")


class MetricSink(Protocol):
    """Receives one metrics record per step (the same dict that is written to metrics.jsonl)."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _record_step(record: dict[str, Any]) -> int:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(
            f"metrics record has step={step!r}; every record needs an integer 'step' "
            f"(got keys {sorted(record)})"
        )
    return step


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The fields a sink forwards: ints and floats other than ``step``. Booleans, strings and
    nested values are skipped; non-finite floats are kept, so that a NaN loss shows up where
    the curves are watched."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardSink:
    """Scalars in TensorBoard event files under ``log_dir``, one tag per record field."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            raise RuntimeError(f"TensorBoardSink({str(self.log_dir)!r}) is closed")
        step = _record_step(record)
        for key, value in numeric_fields(record).items():
            self._writer.add_scalar(key, value, global_step=step)
        # One flush per step, as metrics.jsonl does: a crash then loses at most the step in flight
        # and TensorBoard shows the run as it goes instead of every two minutes.
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run; ``mode="offline"`` (the default) writes it under ``dir`` only,
    for ``wandb sync`` later, so nothing needs a network or an account."""

    def __init__(
        self,
        project: str,
        run_name: str,
        *,
        mode: str = "offline",
        dir: str | Path,
        config: dict[str, Any] | None = None,
    ) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"WandbSink mode={mode!r} is not valid; choose one of {list(WANDB_MODES)}")
        if not project:
            raise ValueError("WandbSink project is empty; name the W&B project")
        if not run_name:
            raise ValueError("WandbSink run_name is empty; name the run")
        import wandb

        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project, name=run_name, mode=mode, dir=str(self.dir), config=config or {}
        )
        # wandb's run.dir is the run's files/ folder; its parent holds the run record
        # (``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`` offline).
        self.run_dir = Path(self._run.dir).parent

    def log(self, record: dict[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError(f"WandbSink({str(self.dir)!r}) is closed")
        step = _record_step(record)
        self._run.log(numeric_fields(record), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def metric_sinks(cfg: Config) -> list[MetricSink]:
    """The sinks ``run.tensorboard`` / ``run.wandb`` ask for (create them on rank 0 only)."""
    run = cfg.run
    sinks: list[MetricSink] = []
    if run.tensorboard:
        sinks.append(TensorBoardSink(Path(run.dir) / "tensorboard"))
    if run.wandb != "off":
        sinks.append(
            WandbSink(project=run.wandb_project, run_name=Path(run.dir).name, mode=run.wandb,
                      dir=run.dir, config=cfg.to_dict())
        )
    return sinks
