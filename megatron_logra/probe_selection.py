"""Which responses of a step's global batch the KL probe runs on (pure Python, no torch).

The probe is ``logra.kl_control.probe_responses`` responses of the *global* batch, chosen by
global index: evenly spaced through the batch, the first one included. A global choice keeps
the probe -- and so alpha -- the same whatever the data-parallel size (a layout must not change
a training run), and spacing them out spreads the probe over the data-parallel ranks' contiguous
shares, so each rank runs its part of the probe instead of the first rank running all of it.
(The authors' probe takes 2 responses per rank: as many as 8 global here on their 4 training
GPUs, but it changes with the data-parallel size.)
"""

from __future__ import annotations


def probe_indices(global_size: int, responses: int) -> list[int]:
    """Global batch indices of the probe: ``responses`` of the ``global_size`` evenly spaced,
    the first one included (every one when the batch has no more)."""
    if global_size < 0 or responses < 1:
        raise ValueError(f"probe_indices({global_size}, {responses}): a batch size >= 0 and at "
                         "least one probe response")
    count = min(responses, global_size)
    return [i * global_size // count for i in range(count)]
