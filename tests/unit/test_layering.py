"""The import rules of the package's layers (DESIGN section 3), checked on the source.

* only ``megatron_logra/mcore/`` (and nothing in ``tools/``) imports Megatron;
* the pure math modules import neither Megatron nor anything of ours above them, and every
  torch.distributed call they make names the process group it was given (no default group,
  no global parallel state);
* the config package, the NeMo-Run recipes and the memory estimator import no torch (a Slurm
  login node parses configs and estimates memory without it), and the portable projection generator imports only torch and the
  standard library (the rollout engine loads it on its own);
* the names of every config choice match the implementations that map them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun import REPO, torchrun_env

PACKAGE = REPO / "megatron_logra"
# Pure math: tensors and explicit process groups in, tensors out.
MATH_MODULES: tuple[str, ...] = (
    "projection", "sketch", "sketch_buffer", "row_adam", "row_adam_paper", "direction", "kl",
    "controller", "master_weights", "row_sharding", "step_scale", "logra_mode", "finite_check",
    "bf16_remainder", "merge_chunks",
    "rl/advantages", "rl/losses", "rl/off_policy", "rl/pass_at_k", "rl/presets",
)
# What a math module may import of ours: other math modules and the config schema (names and
# small configs), nothing that orchestrates.
MATH_MAY_IMPORT = tuple(f"megatron_logra.{name.replace('/', '.')}" for name in MATH_MODULES) + (
    "megatron_logra.config",
)
# torch.distributed functions that need no group to be explicit.
GROUPLESS_DIST_CALLS = frozenset({"is_available", "is_initialized"})


def _source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (functions included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _is_megatron(module: str) -> bool:
    return module == "megatron" or module.startswith("megatron.")


def test_mcore_imports_nothing_of_the_trainers():
    """Megatron's side is below the trainers: what both need (the KL probe's batch, the configs)
    lives below both, never in ``train/``."""
    offenders = []
    for path in _source_files(PACKAGE / "mcore"):
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in _imports(path)
                      if m == "megatron_logra.train" or m.startswith("megatron_logra.train.")]
    assert not offenders, offenders


PLUGIN_MAY_IMPORT = ("megatron_logra.vllm_plugin", "megatron_logra.sync",
                     "megatron_logra.hf_layout", "megatron_logra.hf_names")
# Besides the standard library: what vLLM's venv has (we install ourselves there with --no-deps).
PLUGIN_THIRD_PARTY = {"torch", "vllm", "safetensors"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "vllm_plugin").glob("*.py")),
                         ids=lambda p: p.stem)
def test_vllm_plugin_imports_only_torch_vllm_and_our_torch_only_sync_code(path):
    """The plugin runs in vLLM's venv, where megatron_logra is installed without its
    dependencies: no Megatron, no config schema, nothing of the trainer."""
    imported = _imports(path)
    # ``from megatron_logra import hf_layout`` imports the module megatron_logra.hf_layout.
    ours = [f"megatron_logra.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == "megatron_logra"
            for alias in node.names]
    ours += [m for m in imported if m.startswith("megatron_logra.")]
    assert all(m.startswith(PLUGIN_MAY_IMPORT) for m in ours), ours
    others = {m.split(".")[0] for m in imported if not m.startswith("megatron_logra")}
    assert others <= sys.stdlib_module_names | PLUGIN_THIRD_PARTY | {"__future__"}, others


def test_only_mcore_and_nothing_in_tools_imports_megatron():
    offenders = []
    for path in _source_files(PACKAGE) + _source_files(REPO / "tools"):
        if PACKAGE / "mcore" in path.parents:
            continue
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in _imports(path) if _is_megatron(m)]
    assert not offenders, offenders


@pytest.mark.parametrize("module", MATH_MODULES)
def test_math_module_imports_no_megatron_and_nothing_above_it(module):
    path = PACKAGE / f"{module}.py"
    ours = [m for m in _imports(path) if m.startswith("megatron_logra")]
    assert not [m for m in _imports(path) if _is_megatron(m)]
    assert all(m.startswith(MATH_MAY_IMPORT) for m in ours), ours


def _distributed_aliases(tree: ast.Module) -> set[str]:
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return aliases


@pytest.mark.parametrize("module", MATH_MODULES)
def test_math_module_passes_an_explicit_group_to_every_collective(module):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    aliases = _distributed_aliases(tree)
    implicit = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id in aliases):
            continue
        name = node.func.attr
        if name in GROUPLESS_DIST_CALLS or name[0].isupper():
            continue
        has_group = any(k.arg == "group" for k in node.keywords) or (
            name in ("get_rank", "get_world_size") and node.args
        )
        if not has_group:
            implicit.append(f"line {node.lineno}: dist.{name}")
    assert not implicit, implicit


def _imported_modules(statement: str) -> set[str]:
    """The top-level modules loaded by ``statement`` in a fresh interpreter."""
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], env=torchrun_env(), cwd=REPO,
                            capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in result.stdout.split()}


def test_config_recipes_and_memory_estimator_import_no_torch():
    loaded = _imported_modules(
        "import megatron_logra.config, megatron_logra.recipes, megatron_logra.cli, "
        "megatron_logra.memory.estimate"
    )
    assert "torch" not in loaded and "megatron" not in loaded


def test_projection_generator_imports_only_torch_and_the_standard_library():
    ours = [m for m in _imports(PACKAGE / "projection.py") if m.startswith("megatron_logra")]
    assert ours == []
    assert all(m.split(".")[0] in sys.stdlib_module_names | {"torch", "__future__"}
               for m in _imports(PACKAGE / "projection.py"))


SYNC_MAY_IMPORT = ("megatron_logra.sync", "megatron_logra.projection", "megatron_logra.sketch",
                   "megatron_logra.memory.shapes", "megatron_logra.bf16_remainder")


@pytest.mark.parametrize("path", sorted((PACKAGE / "sync").glob("*.py")), ids=lambda p: p.stem)
def test_sync_package_imports_no_megatron_and_only_what_an_engine_process_can_load(path):
    """The rollout engine (another process, another venv) loads the sync package on its own."""
    imported = _imports(path)
    assert not [m for m in imported if _is_megatron(m)]
    ours = [m for m in imported if m.startswith("megatron_logra")]
    assert all(m.startswith(SYNC_MAY_IMPORT) for m in ours), ours


def test_config_choice_names_match_their_implementations():
    from megatron_logra import config, direction, master_weights, projection
    from megatron_logra.rl import rewards

    assert config.DISTRIBUTIONS == projection.DISTRIBUTIONS
    assert set(config.REWARDS) == set(rewards._REWARD_CLASSES)
    assert set(config.DIRECTIONS) == set(direction.DIRECTION_RULES)
    assert set(config.MASTER_WEIGHTS) == {"auto", *master_weights.MASTER_MODE_NAMES}


@pytest.mark.parametrize("path", sorted((PACKAGE / "rollout").glob("*.py")), ids=lambda p: p.stem)
def test_rollout_package_imports_no_megatron_and_nothing_of_the_trainer(path):
    """The engine protocol and its clients load in a process without Megatron (vLLM's venv);
    the Megatron engine's server side lives in mcore/inference."""
    imported = _imports(path)
    assert not [m for m in imported if _is_megatron(m)]
    ours = [m for m in imported if m.startswith("megatron_logra")]
    # local_ports: a standard-library helper for rendezvous ports, nothing of the trainer.
    assert all(m.startswith(("megatron_logra.rollout", "megatron_logra.config",
                             "megatron_logra.sync", "megatron_logra.local_ports"))
               for m in ours), ours
