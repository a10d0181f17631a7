"""Step metrics: one JSON object per log() call, a console line, and reading them back."""

from __future__ import annotations

import io
import json
import logging
import math

from megatron_logra.train.metrics import MetricsLog, read_metrics

RECORDS = [
    {"step": 3, "loss": 4.123449, "grad_norm": 1.5, "lr": 0.001, "tokens_per_s": 12345.4,
     "step_time_s": 0.1234, "mem_bytes": 512 * 1024 * 1024, "alpha": 0.25},
    {"step": 4, "loss": 3.5, "note": "after resume", "layers": [1, 2]},
]


def test_each_log_call_writes_exactly_one_json_object_with_exactly_the_given_fields(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLog(path, total_steps=20, console=None) as log:
        for record in RECORDS:
            log.log(record)
    lines = path.read_text().splitlines()
    assert len(lines) == len(RECORDS)
    for line, record in zip(lines, RECORDS, strict=True):
        assert json.loads(line) == record


def test_records_are_flushed_as_they_are_logged(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, total_steps=20, console=None)
    log.log(RECORDS[0])
    # another process following the file sees the record before the log is closed
    assert read_metrics(path) == [RECORDS[0]]
    log.close()


def test_read_metrics_round_trips_logged_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, total_steps=20, console=None) as log:
        for record in RECORDS:
            log.log(record)
    assert read_metrics(path) == RECORDS


def test_reopening_appends_to_existing_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, total_steps=20, console=None) as log:
        log.log(RECORDS[0])
    with MetricsLog(path, total_steps=20, console=None) as log:
        log.log(RECORDS[1])
    assert read_metrics(path) == RECORDS


def test_console_line_shows_step_counter_and_formatted_fields():
    console = io.StringIO()
    MetricsLog(None, total_steps=20, console=console).log(RECORDS[0])
    assert console.getvalue() == (
        "step  3/20 | loss 4.1234 | grad_norm 1.500e+00 | lr 1.00e-03 | alpha 0.250"
        " | tok/s 12,345 | 0.123 s | mem 512 MiB\n"
    )


def test_console_line_shows_rl_phase_times_and_policy_sync():
    console = io.StringIO()
    MetricsLog(None, total_steps=9, console=console).log({
        "step": 2, "loss": 1.0, "step_time_s": 1.5, "rollout_time_s": 1.0, "update_time_s": 0.4,
        "sync_bytes": 250352, "sync_time_s": 0.063, "sync_full_bytes": 2232665,
        "sync_weights_match": False,
    })
    assert console.getvalue() == (
        "step 2/9 | loss 1.0000 | 1.500 s | rollout 1.000 s | update 0.400 s"
        " | sync 250,352 B | sync 0.063 s | WEIGHTS DIFFER\n"
    )


def test_console_line_omits_absent_fields_and_non_console_fields():
    console = io.StringIO()
    MetricsLog(None, total_steps=100, console=console).log(RECORDS[1])
    assert console.getvalue() == "step   4/100 | loss 3.5000\n"


def test_without_console_nothing_is_printed(tmp_path, capsys):
    with MetricsLog(tmp_path / "m.jsonl", total_steps=5, console=None) as log:
        log.log(RECORDS[1])
    assert capsys.readouterr().out == ""


def test_non_finite_value_is_logged_as_warning_and_round_trips(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="megatron_logra.train.metrics"):
        with MetricsLog(path, total_steps=5, console=None) as log:
            log.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    assert "loss is nan" in caplog.text
    assert "grad_norm is inf" in caplog.text
    (record,) = read_metrics(path)
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf


def test_rl_console_lines_show_response_length_truncation_and_evaluations():
    console = io.StringIO()
    log = MetricsLog(None, total_steps=20, console=console)
    # rl's record before the first step holds only the evaluation of the starting policy.
    log.log({"step": 0, "eval_pass@1": 0.25, "eval_pass@k": 0.5, "eval_greedy": 0.3,
             "eval_truncated": 0.1, "eval_problems": 8})
    log.log({"step": 1, "loss": 0.5, "reward": 0.25, "response_length": 812.25,
             "truncated_fraction": 0.125})
    assert console.getvalue().splitlines() == [
        "step  0/20 | eval_greedy 0.300 | eval_pass@1 0.250 | eval_truncated 0.10",
        "step  1/20 | loss 0.5000 | reward 0.25 | resp_len 812.2 | truncated 0.12",
    ]
