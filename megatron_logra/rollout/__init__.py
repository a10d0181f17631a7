"""Rollout engines that run apart from the trainer (``rollout.placement=separate``): the protocol
both engines implement (:mod:`.engine`), the built-in Megatron engine served from its own
processes, the client of a vLLM engine in its own venv (:mod:`.vllm_engine`), and the trainer-side policy sync that keeps an engine's weights equal to the
trainer's."""
