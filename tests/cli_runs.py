"""CLI runs launched once per test module and shared by name.

A torchrun job of the real CLI (``torchrun -m megatron_logra <command> <config> <overrides>``)
costs seconds to minutes on CPU, and several tests assert different claims on the same run. A
test module makes one ``CliRuns`` as a module-scoped fixture (its run directories under one
tmp dir) and each test asks it for a run by name: the first test to ask launches it, later ones
get the same run directory. A name means one run: asking again with other settings raises
instead of silently returning the other run. A launch that fails is not cached, so every test
that needs it fails with the job's output.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_logra.train.metrics import read_metrics
from megatron_logra.train.run_files import METRICS_FILE
from tests.layouts import Layout
from tests.torchrun import run_torchrun, torchrun_command


@dataclass
class CliRuns:
    root: Path
    """Run ``name`` writes to ``root / name``, its checkpoints to ``root / f"{name}_ckpt"``."""
    command: str
    """The CLI subcommand: ``train``, ``sft`` or ``rl``."""
    config: Path
    base: Sequence[str]
    """Overrides every run of the module starts from (the model, the optimizer, the steps)."""
    data_dir: Path
    _launched: dict[str, tuple] = field(default_factory=dict, init=False, repr=False)

    def cli_args(self, overrides: Sequence[str], run_dir: Path,
                 checkpoint_dir: Path | None = None) -> list[str]:
        """What follows torchrun's options: the module, the config, base + ``overrides``, dirs."""
        args = ["-m", "megatron_logra", self.command, str(self.config), *self.base, *overrides,
                f"data.dir={self.data_dir}", f"run.dir={run_dir}"]
        if checkpoint_dir is not None:
            args.append(f"checkpoint.dir={checkpoint_dir}")
        return args

    def torchrun_command(self, nproc: int, overrides: Sequence[str], run_dir: Path,
                         checkpoint_dir: Path | None = None) -> list[str]:
        """The full argv, for a test that starts and signals (or expects to fail) the job itself."""
        return torchrun_command(nproc, self.cli_args(overrides, run_dir, checkpoint_dir))

    def launch(self, nproc: int, overrides: Sequence[str], run_dir: Path,
               checkpoint_dir: Path | None = None) -> Path:
        """Run the job now (not cached); raises with its output if it fails."""
        run_torchrun(nproc, self.cli_args(overrides, run_dir, checkpoint_dir))
        return run_dir

    def checkpoint_dir(self, name: str) -> Path:
        return self.root / f"{name}_ckpt"

    def run(self, name: str, nproc: int, overrides: Sequence[str] = (), *,
            checkpointed: bool = False) -> Path:
        """Run ``name`` (launched on first use); with ``checkpointed`` it saves checkpoints."""
        ckpt = self.checkpoint_dir(name) if checkpointed else None
        return self._once(name, ("run", nproc, tuple(overrides), checkpointed),
                          lambda: self.launch(nproc, overrides, self.root / name, ckpt))

    def resumed(self, name: str, first: Layout, second: Layout, *, stop_after: int) -> Path:
        """Steps 1..stop_after at ``first`` (``train.exit_interval``), then resumed from its
        checkpoint (``checkpoint.resume=true``) and finished at ``second``: one run directory."""
        return self.chained(name, [first, second], [stop_after])

    def chained(self, name: str, legs: Sequence[Layout], stops: Sequence[int]) -> Path:
        """Leg ``i`` at ``legs[i]`` runs to step ``stops[i]`` (``train.exit_interval``) and
        saves; the next leg resumes from that checkpoint; the last runs to the end. One run
        directory: every reshard of the chain is checked by one comparison with the
        uninterrupted run, at the price of one job per leg instead of two per reshard."""
        if len(stops) != len(legs) - 1 or list(stops) != sorted(set(stops)):
            raise ValueError(f"chained {name!r}: {len(legs)} legs need {len(legs) - 1} "
                             f"increasing stop steps, got {list(stops)}")

        def launch() -> None:
            ckpt, run_dir = self.checkpoint_dir(name), self.root / name
            for index, (nproc, overrides) in enumerate(legs):
                resume = ["checkpoint.resume=true"] if index else []
                stop = [f"train.exit_interval={stops[index]}"] if index < len(stops) else []
                self.launch(nproc, [*overrides, *resume, *stop], run_dir, ckpt)

        settings = ("chained", tuple((n, tuple(o)) for n, o in legs), tuple(stops))
        return self._once(name, settings, launch)

    def forked(self, name: str, source: str, at_step: int, second: Layout) -> Path:
        """Run ``source``'s checkpoint of step ``at_step`` (a copy) resumed at ``second`` to the
        end: the same as :meth:`resumed` without running the first part again, when ``source``
        was run ``checkpointed`` with a ``checkpoint.interval`` that saves ``at_step``. The run
        directory starts with ``source``'s metrics, of which the resume keeps steps up to
        ``at_step``."""

        def launch() -> None:
            from megatron_logra.mcore.checkpointing.checkpoint import checkpoint_name

            step_dir = checkpoint_name(at_step)
            ckpt, run_dir = self.checkpoint_dir(name), self.root / name
            shutil.copytree(self.checkpoint_dir(source) / step_dir, ckpt / step_dir)
            run_dir.mkdir(parents=True)
            shutil.copy(self.root / source / METRICS_FILE, run_dir / METRICS_FILE)
            self.launch(second[0], [*second[1], "checkpoint.resume=true"], run_dir, ckpt)

        return self._once(name, ("forked", source, at_step, second[0], tuple(second[1])), launch)

    def _once(self, name: str, settings: tuple, launch: Callable[[], object]) -> Path:
        if name in self._launched:
            if self._launched[name] != settings:
                raise ValueError(f"run {name!r} was launched as {self._launched[name]}; "
                                 f"now asked for as {settings}")
        else:
            launch()
            self._launched[name] = settings
        return self.root / name


def run_differences(candidate: Path, reference: Path,
                    weight_err: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[float, float]:
    """The largest relative loss difference over the steps and the largest ``weight_err`` over
    the tensors of two runs (their ``metrics.jsonl`` and ``full_weights.pt``)."""
    got, want = read_metrics(candidate / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    loss = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, want, strict=True))
    w_got = torch.load(candidate / "full_weights.pt")
    w_want = torch.load(reference / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    return loss, max(weight_err(w_got[k], w_want[k]) for k in w_want)
