"""The engines' request/reply channel (megatron_logra/rollout/rpc.py) against a real child process:
replies, refusals, a dead process and a silent one are told apart, and none of them hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_logra.rollout.rpc import EngineError, EngineProcesses, RpcClient

# A server speaking the engines' protocol on two pipes: ``echo`` answers, ``refuse`` answers an
# error, ``die`` exits with code 3, ``hang`` never answers.
_SERVER = textwrap.dedent("""
    import pickle, sys, time
    from multiprocessing.connection import Connection
    requests = Connection(int(sys.argv[1]), writable=False)
    replies = Connection(int(sys.argv[2]), readable=False)
    print("server up", flush=True)
    while True:
        op, body = pickle.loads(requests.recv_bytes())
        if op == "echo":
            replies.send_bytes(pickle.dumps(("ok", body)))
        elif op == "refuse":
            replies.send_bytes(pickle.dumps(("error", "ValueError: no such layer")))
        elif op == "die":
            print("dying on request", flush=True)
            sys.exit(3)
        elif op == "hang":
            time.sleep(600)
""")
# Long enough for a loaded machine to start Python and answer; short enough to keep the test fast.
_REPLY_TIMEOUT_S = 30.0
_SILENT_TIMEOUT_S = 1.0


@pytest.fixture
def client(tmp_path):
    from multiprocessing.connection import Connection

    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    log_path = tmp_path / "server.log"
    processes = EngineProcesses("test engine")
    with open(log_path, "w") as log:
        processes.add("process", subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(req_r), str(rep_w)], pass_fds=(req_r, rep_w),
            stdout=log, stderr=subprocess.STDOUT), log_path)
    os.close(req_r)
    os.close(rep_w)
    rpc = RpcClient(processes, Connection(req_w, readable=False), Connection(rep_r, writable=False),
                    timeout_knob="test.timeout_s")
    yield rpc
    rpc.disconnect()
    processes.stop(kill=True)


def test_a_reply_returns_the_result_and_a_refusal_raises_the_engines_message(client):
    assert client.call("echo", {"x": [1, 2]}, timeout_s=_REPLY_TIMEOUT_S) == {"x": [1, 2]}
    with pytest.raises(EngineError, match="test engine refused refuse: ValueError: no such layer"):
        client.call("refuse", None, timeout_s=_REPLY_TIMEOUT_S)
    assert client.call("echo", 7, timeout_s=_REPLY_TIMEOUT_S) == 7  # still serving


def test_a_dead_engine_process_is_named_with_its_exit_code_and_log_tail(client):
    with pytest.raises(EngineError) as error:
        client.call("die", None, timeout_s=_REPLY_TIMEOUT_S)
    message = str(error.value)
    assert message.startswith("test engine process exited with code 3 while serving die")
    assert "dying on request" in message
    assert not client.connected


def test_a_silent_engine_times_out_naming_the_knob_and_is_stopped(client):
    client.call("echo", 0, timeout_s=_REPLY_TIMEOUT_S)  # up and serving
    with pytest.raises(EngineError, match=r"hang: no reply within 1 s \(test.timeout_s\)"):
        client.call("hang", None, timeout_s=_SILENT_TIMEOUT_S)
    assert not client.connected and client.processes.members == []  # killed, not left behind
    with pytest.raises(EngineError, match="the engine is not running"):
        client.call("echo", 1, timeout_s=_REPLY_TIMEOUT_S)


def test_the_megatron_engines_reply_names_every_rank_that_failed_not_only_rank_0():
    # Issue 21 item 6: a failure on engine rank 1 alone (its own shard) reached no one.
    from megatron_logra.mcore.inference.engine_server import combined_reply

    assert combined_reply([("ok", {"update_count": 3}), ("ok", {"update_count": 3})]) == (
        "ok", {"update_count": 3})
    status, message = combined_reply([("ok", None), ("error", "RuntimeError: out of memory")])
    assert (status, message) == ("error", "engine rank 1: RuntimeError: out of memory")
    status, message = combined_reply([("error", "E: x"), ("error", "E: x"), ("error", "E: y")])
    assert message == "engine ranks 0, 1: E: x; engine rank 2: E: y"
