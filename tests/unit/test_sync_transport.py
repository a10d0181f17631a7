"""The collective transport's channel (megatron_logra/sync/transport.py) between this process and
a real second process over gloo: records split and joined byte for byte, tensor bytes that
arrive exactly, a peer that is gone failing the broadcast at once (never a hang), and a member
whose device does not fit the backend refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_logra.sync.records import DenseUpdate
from megatron_logra.sync.transport import (
    ChannelAddress,
    TensorChannel,
    host_channel,
    join_payload,
    payload_digest,
    split_payload,
)
from megatron_logra.sync.wire import decode, encode
from tests.torchrun import REPO

# Long enough for a loaded machine to start Python and import torch; every wait is bounded by it.
_CHANNEL_TIMEOUT_S = 60.0
# An engine rank: join, receive one record's tensor bytes, print their digest and exit (gone
# before the next record).
_ENGINE = textwrap.dedent("""
    import sys, torch
    from megatron_logra.sync.transport import ChannelAddress, TensorChannel
    host, port, timeout, nbytes = sys.argv[1:5]
    address = ChannelAddress(host, int(port), 2, "gloo", float(timeout))
    channel = TensorChannel.open_engine(address, 0, torch.device("cpu"))
    got = channel.receive(int(nbytes))
    import hashlib; print(hashlib.blake2b(got, digest_size=16).hexdigest(), flush=True)
    channel.close()
""")


def _record() -> bytes:
    value = torch.arange(1000, dtype=torch.float32).reshape(10, 100) / 7
    return encode(DenseUpdate("decoder.final_layernorm.weight", 3, value), wire_dtype="fp32")


def test_a_record_splits_into_header_and_tensor_bytes_and_joins_back_byte_for_byte():
    payload = _record()
    header, tensor_bytes = split_payload(payload)
    assert len(tensor_bytes) == 1000 * 4 and len(header) + len(tensor_bytes) == len(payload)
    joined = join_payload(header, bytes(tensor_bytes))
    assert joined == payload and payload_digest(joined) == payload_digest(payload)
    assert torch.equal(decode(joined).value, decode(payload).value)
    with pytest.raises(ValueError, match="not a header split by split_payload"):
        join_payload(header[:-1], bytes(tensor_bytes))


def _engine(address: ChannelAddress, nbytes: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _ENGINE, address.host, str(address.port), str(address.timeout_s),
         str(nbytes)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def test_tensor_bytes_arrive_exactly_and_a_departed_peer_fails_the_next_broadcast_naming_it():
    _, tensor_bytes = split_payload(_record())
    address, store = host_channel(engine_ranks=1, device=torch.device("cpu"),
                                  timeout_s=_CHANNEL_TIMEOUT_S)
    engine = _engine(address, len(tensor_bytes))
    try:
        channel = TensorChannel.open_trainer(address, store, torch.device("cpu"))
        channel.send(tensor_bytes)
        out, err = engine.communicate(timeout=_CHANNEL_TIMEOUT_S)
        assert engine.returncode == 0, err
        assert out.strip() == payload_digest(bytes(tensor_bytes))
        # The engine rank is gone: the next record's broadcast fails (gloo sees the closed
        # connection) instead of waiting for it.
        with pytest.raises(RuntimeError, match=r"sync channel \(gloo, .*rank 0 of 2.*failed to "
                                               r"send 4000 bytes"):
            channel.send(tensor_bytes)
    finally:
        engine.kill()
        engine.wait()


def test_a_member_whose_device_does_not_fit_the_backend_is_refused_before_joining():
    address = ChannelAddress("127.0.0.1", 1, 2, "nccl", 1.0)
    with pytest.raises(RuntimeError, match="uses nccl .* needs CUDA tensors on every member"):
        TensorChannel(address, 1, store=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="channel backend 'mpi' is not one of"):
        TensorChannel(ChannelAddress("127.0.0.1", 1, 2, "mpi", 1.0), 1, store=None,
                      device=torch.device("cpu"))
