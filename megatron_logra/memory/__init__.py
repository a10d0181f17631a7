"""Memory, as analysis: the analytic per-GPU estimator of dense Adam, LoRA and LoGRA
(:mod:`.estimate`, on :mod:`.shapes` and :mod:`.activations`; pure Python, no torch) and the
live-tensor tracker that measures what a step really keeps (:mod:`.live_tensors`)."""
