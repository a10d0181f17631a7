"""Exact accounting of live tensor storage on any device, by category, with the peak.

On CPU there is no allocator to ask (``torch.cuda.max_memory_allocated`` has no CPU twin), and
peak RSS mixes tensors with the interpreter, libraries and malloc's retained pages. This module
counts tensor storage itself:

* **allocations**: a ``TorchDispatchMode`` sees the outputs of every ATen operator run while
  the tracker is active -- forward, backward (the autograd engine carries the mode into its
  ops), factories (``torch.zeros``, ``torch.tensor``), collectives' output buffers. Each output
  whose storage is new is counted with its ``nbytes``; a storage that an op resizes in place is
  re-measured;
* **frees**: a weak reference to each counted storage fires when the storage is freed -- when
  its last tensor or view dies, not when one tensor referring to it does -- and subtracts it;
* **categories**: a new storage is a ``temporaries`` storage; ``saved_tensors_hooks`` reclassify
  a temporary that autograd saves for backward as ``activations``; callers label persistent
  state (weights, gradient buffers, optimizer state, sketches, adapters) by tensors or wholesale.

Storage, not tensors, is the unit: views and in-place ops add nothing, and a grad buffer with
many ``main_grad`` views counts once. The peak is checked after every operator, while the op's
inputs are still alive, so it is the true maximum of live counted bytes over the tracked span.

Not counted: storages that existed before the tracker started and were not labelled (they are
invisible to it, so freeing them does not underflow), tensors made without an ATen operator
(``torch.from_numpy``), scratch buffers an operator allocates and frees inside its own kernel
(e.g. BLAS packing), and allocations in threads the mode does not cover (gloo's internal
buffers). Those show up only in RSS.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TEMPORARIES = "temporaries"
"""A storage the tracker saw allocated and nobody labelled or saved for backward."""
ACTIVATIONS = "activations"
"""A temporary that autograd saved for backward (until it is freed)."""


@dataclass(frozen=True)
class LiveTensorReport:
    """Counted bytes now and at the peak, in total and by category."""

    live_bytes: int
    peak_bytes: int
    live_by_category: dict[str, int] = field(default_factory=dict)
    peak_by_category: dict[str, int] = field(default_factory=dict)
    """The categories at the moment of the peak (they sum to ``peak_bytes``)."""


@dataclass
class _Span:
    peak_bytes: int = 0
    """The most live bytes during the span (set when it ends)."""


@dataclass
class _Entry:
    nbytes: int
    category: str
    ref: weakref.ref


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: LiveTensorTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._tracker._observe(out)
        return out


def _countable(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.device.type != "meta"
    )


class LiveTensorTracker:
    """Count live tensor storage while active (``with tracker:``), by category, with the peak.

    The counts stay valid after the ``with`` block: frees keep being subtracted; new
    allocations are no longer seen. Thread-safe; one instance may be entered again later.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._totals: dict[str, int] = {TEMPORARIES: 0, ACTIVATIONS: 0}
        self._live = 0
        self._peak = 0
        self._peak_totals: dict[str, int] = dict(self._totals)
        self._mode: _Mode | None = None
        self._hooks: Any = None

    # ------------------------------------------------------------------ context

    def __enter__(self) -> LiveTensorTracker:
        if self._mode is not None:
            raise RuntimeError("this LiveTensorTracker is already active; enter it once")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, hooks = self._mode, self._hooks
        self._mode = self._hooks = None
        mode.__exit__(*exc)
        hooks.__exit__(*exc)

    # ------------------------------------------------------------------ bookkeeping

    def _add(self, key: int, storage: torch.UntypedStorage, category: str) -> None:
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, lambda _ref, key=key: self._freed(key))
        self._entries[key] = _Entry(nbytes, category, ref)
        self._totals[category] = self._totals.get(category, 0) + nbytes
        self._live += nbytes

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            self._totals[entry.category] -= entry.nbytes
            self._live -= entry.nbytes

    def _update_peak(self) -> None:
        if self._live > self._peak:
            self._peak = self._live
            self._peak_totals = dict(self._totals)

    def _observe(self, out: Any) -> None:
        with self._lock:
            for value in tree_leaves(out):
                if not _countable(value):
                    continue
                storage = value.untyped_storage()
                key = storage._cdata
                entry = self._entries.get(key)
                if entry is None:
                    self._add(key, storage, TEMPORARIES)
                    continue
                nbytes = storage.nbytes()
                if nbytes != entry.nbytes:  # resized in place (resize_, set_)
                    self._totals[entry.category] += nbytes - entry.nbytes
                    self._live += nbytes - entry.nbytes
                    entry.nbytes = nbytes
            self._update_peak()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if _countable(tensor):
            with self._lock:
                entry = self._entries.get(tensor.untyped_storage()._cdata)
                if entry is not None and entry.category == TEMPORARIES:
                    self._move(entry, ACTIVATIONS)
        # A detached alias, not the tensor itself: a saved *output* returned as is would hold
        # its own grad_fn (a reference cycle that only the garbage collector frees), so memory
        # would be released later than without the tracker. Autograd re-attaches the graph
        # when it unpacks.
        return tensor.detach()

    def _move(self, entry: _Entry, category: str) -> None:
        self._totals[entry.category] -= entry.nbytes
        self._totals[category] = self._totals.get(category, 0) + entry.nbytes
        entry.category = category

    # ------------------------------------------------------------------ labels

    def label(self, tensors: Iterable[torch.Tensor | None], category: str) -> int:
        """Put the storages of ``tensors`` into ``category``; returns their bytes.

        A storage the tracker has not seen (allocated before it started) is counted from now
        on. ``None`` entries are skipped, so ``(p.grad for p in params)`` can be passed as is.
        """
        if not category:
            raise ValueError("category is empty; name it, e.g. 'weights'")
        labelled = 0
        with self._lock:
            seen: set[int] = set()
            for tensor in tensors:
                if tensor is None:
                    continue
                if not _countable(tensor):
                    raise ValueError(
                        f"cannot label a {tensor.layout} tensor on {tensor.device}: only "
                        "strided tensors with storage are counted"
                    )
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in seen:
                    continue
                seen.add(key)
                entry = self._entries.get(key)
                if entry is None:
                    self._add(key, storage, category)
                    entry = self._entries[key]
                else:
                    self._move(entry, category)
                labelled += entry.nbytes
            self._update_peak()
        return labelled

    def label_live(self, category: str, *, source: str = TEMPORARIES) -> int:
        """Move every live storage now in ``source`` to ``category``; returns the bytes moved.

        E.g. after a warm-up step, everything still alive is state that lives between steps.
        """
        if not category:
            raise ValueError("category is empty; name it, e.g. 'persistent'")
        moved = 0
        with self._lock:
            # A copy: a weakref callback may drop entries while this loop runs.
            for entry in list(self._entries.values()):
                if entry.category == source:
                    moved += entry.nbytes
                    self._move(entry, category)
        return moved

    # ------------------------------------------------------------------ readings

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        with self._lock:
            self._peak = self._live
            self._peak_totals = dict(self._totals)

    @contextmanager
    def span(self) -> Iterator[_Span]:
        """The peak of a span of the tracked work on its own (``span.peak_bytes`` after it),
        while the tracker's own peak stays the maximum over everything."""
        with self._lock:
            outer, outer_totals = self._peak, self._peak_totals
            self._peak, self._peak_totals = self._live, dict(self._totals)
        span = _Span()
        try:
            yield span
        finally:
            with self._lock:
                span.peak_bytes = self._peak
                if outer >= self._peak:
                    self._peak, self._peak_totals = outer, outer_totals

    @property
    def live_bytes(self) -> int:
        return self._live

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def report(self) -> LiveTensorReport:
        with self._lock:
            return LiveTensorReport(
                live_bytes=self._live,
                peak_bytes=self._peak,
                live_by_category={k: v for k, v in self._totals.items() if v},
                peak_by_category={k: v for k, v in self._peak_totals.items() if v},
            )


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
