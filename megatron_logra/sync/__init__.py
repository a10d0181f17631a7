"""Low-rank policy sync: the trainer's LoGRA updates shipped as factors, replayed by the engine.

No Megatron here (tensors only): the rollout engine side (:mod:`.shadow`) runs in processes that
never import Megatron. :mod:`.records` are the record types, :mod:`.wire` their byte encoding,
:mod:`.shadow` the engine's exact shadow of its weights (:mod:`.shard` the part one engine
rank keeps), :mod:`.checksum` the weight digest both sides compare, :mod:`.sizes` the byte
counts. docs/sync.md describes the protocol.
"""
