"""TensorBoard and W&B sinks write the numeric fields of each metrics record at its step, read
back with each tool's own file format."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import pytest

from megatron_logra.train.metric_sinks import TensorBoardSink, WandbSink

# TensorBoard stores scalars as float32: a float64 value comes back rounded to 24 significant
# bits, i.e. within half a float32 ulp, 2**-24 relative.
FLOAT32_ROUNDING_REL = 2.0**-24

RECORDS = [
    {"step": 1, "loss": 4.857602357864380, "lr": 0.0, "tokens": 1024, "grad_norm": 1.9450066873783578,
     "layout": "tp2", "logra": True},
    {"step": 2, "loss": 4.870595216751099, "lr": 6.000000000000001e-04, "tokens": 1024,
     "grad_norm": 1.9552677455107066, "layout": "tp2", "logra": True},
    {"step": 5, "loss": 3.125, "lr": 3.0e-3, "tokens": 2048, "grad_norm": 0.5,
     "layout": "tp2", "logra": True},
]
NUMERIC_KEYS = {"loss", "lr", "tokens", "grad_norm"}


def test_tensorboard_event_files_hold_each_numeric_field_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for record in RECORDS:
        sink.log(record)
    sink.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == NUMERIC_KEYS
    for key in NUMERIC_KEYS:
        logged = [(r["step"], float(r[key])) for r in RECORDS]
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [step for step, _ in read] == [step for step, _ in logged], key
        for (_, want), (_, got) in zip(logged, read, strict=True):
            assert math.isclose(got, want, rel_tol=FLOAT32_ROUNDING_REL), (key, got, want)


def test_tensorboard_keeps_a_nan_loss_visible(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.log({"step": 3, "loss": float("nan")})
    sink.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    (event,) = events.Scalars("loss")
    assert event.step == 3 and math.isnan(event.value)


def test_a_record_without_an_integer_step_is_refused(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    with pytest.raises(ValueError, match="integer 'step'"):
        sink.log({"loss": 1.0})
    with pytest.raises(ValueError, match="step='3'"):
        sink.log({"step": "3", "loss": 1.0})
    sink.close()


def test_wandb_sink_refuses_an_unknown_mode_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"mode='cloud' is not valid; choose one of \['offline'"):
        WandbSink("p", "r", mode="cloud", dir=tmp_path)


# ------------------------------------------------------------------- W&B offline run files
# A .wandb file is a 7-byte header (b":W&B", a 2-byte magic, a version byte) followed by the
# LevelDB log format: 32 KiB blocks of chunks, each `crc32 (4, LE) | length (2, LE) | type (1)`
# then the payload; type 1 is a whole record, 2/3/4 the first/middle/last piece of one. The crc
# covers the type byte and the payload. Each record is a serialized wandb_internal Record.
_WANDB_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records: list[bytes] = []
    pending = b""
    pos = _WANDB_HEADER
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # too small for a chunk header: block padding
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"bad checksum at byte {pos} of {path}"
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            records.append(payload)
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            records.append(pending + payload)
        else:
            raise AssertionError(f"unknown chunk type {kind} at byte {pos} of {path}")
    return records


def _wandb_history(path: Path) -> dict[int, dict[str, object]]:
    """step -> {key: value} of every history row in a .wandb file (wandb's own keys, which
    start with '_', left out)."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict[str, object]] = {}
    for payload in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            if not key.startswith("_"):
                row[key] = json.loads(item.value_json)
        history[record.history.step.num] = row
    return history


@pytest.fixture
def wandb_offline_env(tmp_path, monkeypatch):
    """Everything wandb writes stays under tmp_path, nothing goes to the network."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    import wandb

    # wandb keeps a service process for later runs; stop it so the test leaves nothing behind.
    wandb.teardown()


def test_wandb_offline_run_history_holds_each_numeric_field_at_its_step(tmp_path, wandb_offline_env):
    sink = WandbSink("megatron-logra-test", "sinks", mode="offline", dir=tmp_path / "wb")
    for record in RECORDS:
        sink.log(record)
    sink.close()
    # finish() returns once wandb's service process has the data; the service writes the
    # offline file asynchronously. Shutting the service down waits for that write.
    import wandb

    wandb.teardown()

    assert sink.run_dir.parent == tmp_path / "wb" / "wandb"
    (run_file,) = sink.run_dir.glob("run-*.wandb")
    history = _wandb_history(run_file)
    assert history == {r["step"]: {k: r[k] for k in NUMERIC_KEYS} for r in RECORDS}
