"""The Megatron rollout engine's processes: ``python -m megatron_logra.mcore.inference.engine_server``.

Started by :class:`megatron_logra.rollout.megatron_engine.MegatronEngine` (never by hand), one
process per engine TP rank, in a world of their own. Each rank builds the trainer's GPT at the
engine's layout and keeps an :class:`~megatron_logra.sync.shadow.EngineShadow` of its own TP
shard of every weight (Megatron's slicing, :func:`~megatron_logra.sync.shard.megatron_tp_shard`):
the records address the full (TP=1) tensors, and the shadow replays each merge that touches its
shard on a block of the trainer's shape, which keeps it exact for any engine TP (docs/sync.md,
"What is exact"); it copies each changed served shard into the model it samples with. Rank 0
serves the trainer's connection and broadcasts each request to the other ranks, so every rank
executes every request in the same order. A request that fails on the engine is answered with the
error (every rank raises the same one, all execute the same code on the same inputs) and the
engine keeps serving; a refused sync record changes nothing.

While the trainer is busy (its policy update) rank 0 broadcasts an ``idle`` request every
``ENGINE_IDLE_BROADCAST_S`` so the other ranks' collectives never reach the process group's
timeout (the config refuses a ``parallel.collective_timeout_s`` that is not above it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.config import config_from_dict
from megatron_logra.config.rollout import ENGINE_IDLE_BROADCAST_S
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer
from megatron_logra.mcore.inference.sampler import MegatronSampler
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.models.sharding import (
    full_shape,
    gather_full,
    global_named_parameters,
    partition_of,
)
from megatron_logra.mcore.process_groups import destroy_parallel, init_parallel
from megatron_logra.rl.rollout import SamplingParams
from megatron_logra.rollout.megatron_engine import AUTHKEY_ENV, ENGINE_PROTOCOL
from megatron_logra.rollout.rpc import disable_nagle
from megatron_logra.sync.checksum import weight_checksum
from megatron_logra.sync.replay_device import replay_device
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.shard import megatron_tp_shard
from megatron_logra.sync.transport import ChannelAddress, TensorChannel, payload_digest
from megatron_logra.sync.wire import decode

logger = logging.getLogger(__name__)
_PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class EngineRank:
    """One engine rank: its model shard, the sampler on it, the shadow of its shard."""

    def __init__(self, cfg, groups, shadow_targets: list[str]) -> None:
        self.groups = groups
        tokenizer = load_run_tokenizer(cfg)
        self.chunks = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
        self.sampler = MegatronSampler(self.chunks, groups, vocab_size=tokenizer.vocab_size)
        self.params = dict(global_named_parameters(self.chunks[0]))
        # An fp32 shadow of the targets only where low-rank records arrive: the trainer names
        # them (its engine_shadow_targets; full and delta sync hand the engine its served
        # weights). The engine's own config is colocated and has no sync section to read.
        targets = list(shadow_targets)
        missing = sorted(set(targets) - self.params.keys())
        if missing:
            raise RuntimeError(f"the engine's model has no parameters {missing[:4]}")
        tp_rank, tp_size = groups.tp_rank, groups.tp_size
        shards = {name: megatron_tp_shard(full_shape(param, tp_size), *partition_of(param),
                                          tp_rank, tp_size)
                  for name, param in self.params.items()}
        # Full syncs are checked against the model's names and full shapes on every rank alike:
        # a shard's own fit alone let rank 0 take a tensor of another shape that rank 1 refused.
        self.shadow = EngineShadow(targets, served_dtype=_PARAMS_DTYPES[cfg.model.params_dtype],
                                   shards=shards,
                                   model_shapes={name: full_shape(param, tp_size)
                                                 for name, param in self.params.items()})
        self.channel: TensorChannel | None = None  # sync.transport=collective

    def handle(self, op: str, body: Any) -> Any:
        if op == "hello":
            if body.get("protocol") != ENGINE_PROTOCOL:
                raise RuntimeError(f"protocol mismatch: the trainer speaks "
                                   f"{body.get('protocol')!r}, this engine {ENGINE_PROTOCOL!r}")
            # Merges are replayed on the trainer's kind of device where this rank has one.
            self.shadow.replay_device = replay_device(body["merge_device"], self.groups.device)
            return {"protocol": ENGINE_PROTOCOL, "tp": self.groups.tp_size,
                    "targets": sorted(self.shadow.target_names),
                    "replay_device": self.shadow.replay_device.type}
        if op == "generate":
            return self._generate(body)
        if op == "sync":
            return self._sync(body)
        if op == "open_channel":
            address = ChannelAddress(**body["address"])
            device = (torch.device("cuda", torch.cuda.current_device())
                      if address.backend == "nccl" else torch.device("cpu"))
            self.channel = TensorChannel.open_engine(address, self.groups.world_rank, device)
            return {"channel_rank": self.channel.rank}
        if op == "sync_collective":
            if self.channel is None:
                raise RuntimeError("sync_collective before open_channel")
            # Every rank receives its copy of the tensor bytes from the trainer directly.
            payload = self.channel.receive_payload(body["header"], body["nbytes"])
            return {**self._sync(payload), "digest": payload_digest(payload)}
        if op == "checksums":
            return {name: weight_checksum(gather_full(param, self.groups.tp,
                                                      self.groups.tp_size))
                    for name, param in self.params.items()}
        if op == "idle":
            return None
        raise RuntimeError(f"unknown request {op!r}")

    def _generate(self, body: dict) -> list:
        params = SamplingParams(max_new_tokens=body["max_new_tokens"],
                                temperature=body["temperature"], top_p=body["top_p"],
                                stop_ids=tuple(body["stop_token_ids"]))
        batch = self.sampler.generate(body["prompts"], params, seed=body["seed"])
        lengths = batch.response_lengths.tolist()
        return [(batch.response_tokens[i, :n].tolist(), batch.logprobs[i, :n].tolist())
                for i, n in enumerate(lengths)]

    def _sync(self, payload: bytes) -> dict:
        record = decode(payload)
        changed = self.shadow.apply(record)  # raises, changing nothing, on a refused record
        with torch.no_grad():
            for name in changed:
                self.params[name].copy_(self.shadow.served[name])  # this rank's shard
        return {"update_count": getattr(record, "update_count", None)}


def combined_reply(replies: list[tuple[str, Any]]) -> tuple[str, Any]:
    """The trainer's answer from every engine rank's ``(status, value)``, in rank order: rank 0's
    value if all succeeded, else an error naming each rank that failed and its message."""
    failed: dict[str, list[int]] = {}
    for r, (status, value) in enumerate(replies):
        if status != "ok":
            failed.setdefault(value, []).append(r)
    if not failed:
        return replies[0]
    return "error", "; ".join(
        f"engine rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in failed.items())


def _publish_port(port_file: Path, port: int) -> None:
    """Write the listener's port where the trainer waits for it (whole or not at all)."""
    staged = port_file.with_suffix(".tmp")
    staged.write_text(str(port))
    staged.replace(port_file)


def serve(cfg, port_file: Path, authkey: bytes, shadow_targets: list[str]) -> None:
    groups = init_parallel(cfg)
    world = dist.group.WORLD
    rank = None
    try:
        rank = EngineRank(cfg, groups, shadow_targets)
        conn = None
        if groups.world_rank == 0:
            # The kernel picks the port as the listener binds it, so no other socket can take
            # it between a choice and the bind; the trainer reads it from the file.
            listener = Listener(("127.0.0.1", 0), authkey=authkey)
            _publish_port(port_file, listener.address[1])
            conn = listener.accept()
            disable_nagle(conn)  # replies over 16 KiB (rollouts, digests) would wait ~40 ms
        while True:
            message: list[Any] = [None]
            if conn is not None:
                try:
                    message[0] = conn.recv() if conn.poll(ENGINE_IDLE_BROADCAST_S) else ("idle", None)
                except (EOFError, OSError):
                    message[0] = ("close", None)  # the trainer went away
            dist.broadcast_object_list(message, src=0, group=world)
            op, body = message[0]
            if op == "close":
                break
            try:
                reply = ("ok", rank.handle(op, body))
            except Exception as error:  # noqa: BLE001 -- answered to the trainer, named there
                reply = ("error", f"{type(error).__name__}: {error}")
                logger.warning("request %s failed: %s", op, reply[1])
            if op == "idle":
                continue
            # Every rank's status reaches the reply: a rank that failed on its own shard would
            # otherwise leave it stale, unseen until a checksum.
            replies: list[Any] = [None] * groups.world_size if groups.world_rank == 0 else []
            dist.gather_object(reply, replies if groups.world_rank == 0 else None, dst=0,
                               group=world)
            if conn is not None:
                conn.send(combined_reply(replies))
    finally:
        if rank is not None and rank.channel is not None:
            rank.channel.close()
        destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the engine config (JSON)")
    parser.add_argument("--port-file", type=Path, required=True,
                        help="rank 0 writes the port it listens on here")
    parser.add_argument("--shadow-targets", required=True,
                        help="JSON list of the parameters the engine keeps an fp32 shadow of")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = config_from_dict(json.loads(open(args.config).read())).resolved(world, "rl")
    shadow_targets = json.loads(open(args.shadow_targets).read())
    serve(cfg, args.port_file, bytes.fromhex(os.environ[AUTHKEY_ENV]), shadow_targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
