"""The trainers: one run loop (:mod:`.loop`) shared by ``train`` / ``sft``
(:mod:`.supervised`) and ``rl`` (:mod:`.rl`), and the run's plumbing (metrics and their
mirrors, plots, preemption, run-directory files). Orchestration only: everything that touches
Megatron goes through the API of :mod:`megatron_logra.mcore`."""
