"""Run Megatron-Core on CPU over gloo: an explicitly enabled compatibility layer.

Megatron-Core 0.16 assumes CUDA in four places on its training path. With these four process-wide
adjustments the same TP/SP/PP/DP code, the DDP grad buffers, the distributed optimizer and the
schedules run on CPU over gloo and give the numbers a GPU run gives (to float rounding):

1. the model-parallel RNG tracker keeps CPU generator states instead of ``torch.cuda`` ones;
2. ``torch.cuda.current_device()`` answers the CPU device (Megatron passes it as ``device=``),
   and streams, events, ``synchronize`` and ``empty_cache`` become no-ops;
3. tensor factories and ``Tensor.to`` map ``device="cuda"`` (or a CUDA index) to the CPU, because
   schedules, the causal mask, clip_grads and the optimizers hard-code that string (and the
   factories ignore ``pin_memory=True``, which the context-parallel rotary slice asks for and a
   CPU-only torch refuses);
4. a no-argument ``Tensor.type()`` reports ``torch.cuda.FloatTensor``-style names, because the
   optimizers compare against them.

Nothing is patched on import. :func:`enable_cpu_compat` is called by the launcher when the run's
device is ``cpu`` and must never be called in a GPU process: (4) would make CPU tensors look like
CUDA ones to any code that checks ``.type()``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_enabled = False

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace",
)


def cpu_compat_enabled() -> bool:
    return _enabled


def enable_cpu_compat() -> None:
    """Apply the four adjustments (idempotent). Call before building any Megatron object."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "the CPU compatibility layer was asked for in a process that sees a GPU; run with "
            "parallel.device=cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) for a CPU run"
        )
    # Forward-mode AD compiles its decompositions with TorchScript on first use, and that
    # compilation fails once the factories below are wrapped; load it while they are intact.
    importlib.import_module("torch._decomp.decompositions_for_jvp")

    _patch_rng_tracker()
    _patch_cuda_runtime()
    _patch_device_strings()
    _patch_type_strings()
    _enabled = True
    logger.info("Megatron-Core CPU compatibility layer enabled (gloo backend)")


def _patch_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as mcore_random

    class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        """Megatron's tracker of named RNG states, holding CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"RNG seed {seed} already exists in the tracker")
            self.seeds_.add(seed)
            if name in self.states_:
                raise RuntimeError(f"RNG state {name!r} already exists in the tracker")
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"RNG state {name!r} is not in the tracker")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation recompute saves and restores "the CUDA" RNG state through these two.
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(
        new_state
    )
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *args: Any) -> bool:
        return False


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, memory_format=None: self
    torch.nn.Module.cuda = lambda self, device=None: self


def _is_cuda_device(device: Any) -> bool:
    if device is None or isinstance(device, bool):
        return False
    return isinstance(device, int) or str(device).startswith("cuda")


def _patch_device_strings() -> None:
    for name in _FACTORIES:
        factory = getattr(torch, name)

        @functools.wraps(factory)
        def on_cpu(*args: Any, __factory: Any = factory, **kwargs: Any) -> Any:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            return __factory(*args, **kwargs)

        setattr(torch, name, on_cpu)

    original_to = torch.Tensor.to

    def to_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and not isinstance(args[0], torch.dtype) and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to_on_cpu


def _patch_type_strings() -> None:
    original_type = torch.Tensor.type

    def type_as_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
                     **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original_type(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_as_cuda
