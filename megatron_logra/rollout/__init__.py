"""Rollout engines that run apart from the trainer (``rollout.placement=separate``): the protocol
both engines implement (:mod:`.engine`), the built-in Megatron engine served from its own
processes, the client of a vLLM engine in its own venv (:mod:`.vllm_engine`), the request/reply
channel both clients share (:mod:`.rpc`), the collective transport of sync records
(:mod:`.collective_sync`) and the engine's GPU placement (:mod:`.placement`)."""
