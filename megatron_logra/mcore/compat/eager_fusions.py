"""Without CUDA, Megatron's fused elementwise helpers stay eager functions.

``megatron.core.jit`` decorates its fused helpers (bias-GeLU/SwiGLU/GeGLU, squared ReLU, the
L2 norm, ...) with ``torch.compile`` when ``megatron.core`` is imported. The decoration alone
imports TorchDynamo and Inductor: about 3 s of CPU per process, half the cost of importing
``megatron.core``, paid by every rank of every CPU job for kernels the CPU model never calls
(its transformer config switches every fusion off). Before the first import of Megatron this
module hooks the loading of ``megatron.core.jit`` and calls Megatron's own
``disable_jit_fuser()`` right after it, so the helpers are decorated with its no-op decorator.
With CUDA available nothing changes.

Importing this module installs the hook; ``megatron_logra.mcore`` imports it first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

import torch

JIT_MODULE = "megatron.core.jit"


class _DisableJitAfterLoading(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.disable_jit_fuser()


class _EagerJitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001 (the finder protocol)
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableJitAfterLoading(spec.loader)
        return spec


def keep_fusions_eager_without_cuda() -> bool:
    """Install the hook (once) unless CUDA is available or Megatron is already imported;
    returns whether Megatron's helpers will be eager."""
    if any(isinstance(finder, _EagerJitFinder) for finder in sys.meta_path):
        return True
    if JIT_MODULE in sys.modules or torch.cuda.is_available():
        return False
    sys.meta_path.insert(0, _EagerJitFinder())
    return True


keep_fusions_eager_without_cuda()
