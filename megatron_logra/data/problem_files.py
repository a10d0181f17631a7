"""Problem files: JSONL or Parquet rows -> :class:`PromptProblem`, and which file a split is.

A row's prompt (``data.prompt_key``) is a string or a chat ``messages`` list of ``{"role",
"content"}`` turns: the last user turn is the prompt, the turns before it its context, and a
trailing assistant turn the supervised target. Its answer (``data.answer_key``) is a string or
a number. Keys are dotted paths into nested rows (Parquet struct columns read as mappings).
Every error names the file, the row, the key and what was found there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_logra.config import SPLIT_CANDIDATES, DataConfig
from megatron_logra.data.prompt_data import PromptProblem

SPLIT_KEYS = {"train": "train_file", "test": "test_file", "validation": "validation_file"}
DATA_TOOLS_HINT = ("tools/prepare_dataset.py converts GSM8K, MATH / DeepScaleR and verl "
                   "Parquet files; tools/make_synthetic_data.py writes the synthetic task")
ROLES = ("system", "user", "assistant")
_MISSING = object()


def split_file(data: DataConfig, split: str) -> Path:
    """The problem file of ``split`` (``train``, ``test``, ``validation``): data.<split>_file
    relative to data.dir, or the one candidate of SPLIT_CANDIDATES present in data.dir."""
    key = SPLIT_KEYS[split]
    base = Path(data.dir)
    explicit = getattr(data, key)
    if explicit is not None:
        path = base / explicit
        if not path.is_file():
            raise ValueError(f"data.{key}={explicit!r}: {path} does not exist; point it at the "
                             f"{split} problems (relative to data.dir or absolute)")
        return path
    if not base.is_dir():
        raise ValueError(f"data.dir={data.dir!r} does not exist; point it at the dataset "
                         f"directory ({DATA_TOOLS_HINT})")
    found = [base / name for name in SPLIT_CANDIDATES[split] if (base / name).is_file()]
    if len(found) > 1:
        raise ValueError(f"data.dir={data.dir!r} holds {[p.name for p in found]}, more than one "
                         f"{split} split; choose one with data.{key}=NAME")
    if not found:
        extra = ("; `tools/make_synthetic_data.py --num-valid N` writes one for the synthetic "
                 "task, or set rl.eval.split=test" if split == "validation" else "")
        raise ValueError(
            f"data.dir={data.dir!r} has no {split} split (looked for "
            f"{', '.join(SPLIT_CANDIDATES[split])}); name the file with data.{key}=NAME "
            f"({DATA_TOOLS_HINT}){extra}"
        )
    return found[0]


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` per row of a JSONL (``file:line``) or Parquet (``file row N``) file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as error:  # noqa: BLE001 -- any unreadable file is the user's to fix
            raise ValueError(f"{path} is not a readable Parquet file ({error})") from None
        for number, row in enumerate(rows, 1):
            yield f"{path} row {number}", row
        return
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object of "
                                 "fields")
            yield where, row


def _lookup(row: dict[str, Any], key: str) -> Any:
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _missing(where: str, row: dict[str, Any], key: str, knob: str) -> ValueError:
    parts = key.split(".")
    node: Any = row
    walked = []
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
        walked.append(part)
    if walked:
        found = (f"{'.'.join(walked)!r} holds {sorted(node)}" if isinstance(node, dict)
                 else f"{'.'.join(walked)!r} is a {type(node).__name__}")
    else:
        found = f"the row has keys {sorted(row)}"
    return ValueError(f"{where}: no {knob}={key!r} ({found}); set {knob} to the row's field")


def _text(where: str, knob: str, key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: {knob}={key!r} is a {type(value).__name__} ({value!r:.80}), "
                     "expected a string or a number")


def _messages(where: str, key: str, turns: list[Any]) -> list[tuple[str, str]]:
    out = []
    for index, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str)):
            raise ValueError(f"{where}: data.prompt_key={key!r} turn {index} is {turn!r:.80}; a "
                             "messages list holds {\"role\": ..., \"content\": ...} strings")
        if turn["role"] not in ROLES:
            raise ValueError(f"{where}: data.prompt_key={key!r} turn {index} has role "
                             f"{turn['role']!r}; use one of {list(ROLES)}")
        out.append((turn["role"], turn["content"]))
    return out


def problem_from_row(where: str, row: dict[str, Any], data: DataConfig) -> PromptProblem:
    prompt = _lookup(row, data.prompt_key)
    if prompt is _MISSING:
        raise _missing(where, row, data.prompt_key, "data.prompt_key")
    answer = _lookup(row, data.answer_key)
    if answer is _MISSING:
        raise _missing(where, row, data.answer_key, "data.answer_key")
    answer = _text(where, "data.answer_key", data.answer_key, answer)
    response = None
    if data.response_key is not None:
        value = _lookup(row, data.response_key)
        if value is _MISSING:
            raise _missing(where, row, data.response_key, "data.response_key")
        response = _text(where, "data.response_key", data.response_key, value)
    if isinstance(prompt, str):
        return PromptProblem(prompt, answer, response=response, origin=where)
    if not isinstance(prompt, list):
        raise ValueError(f"{where}: data.prompt_key={data.prompt_key!r} is a "
                         f"{type(prompt).__name__} ({prompt!r:.80}), expected a string or a "
                         "messages list")
    turns = _messages(where, data.prompt_key, prompt)
    if turns and turns[-1][0] == "assistant":
        target = turns.pop()[1]
        response = target if response is None else response
    if not turns or turns[-1][0] != "user":
        raise ValueError(f"{where}: data.prompt_key={data.prompt_key!r} must end with a user "
                         "turn (optionally followed by the assistant's answer), got roles "
                         f"{[role for role, _ in turns]}")
    return PromptProblem(turns[-1][1], answer, context=tuple(turns[:-1]), response=response,
                         origin=where)


def load_problems(path: str | Path, data: DataConfig | None = None) -> list[PromptProblem]:
    """Every row of a problem file (``data``'s keys; the defaults without it)."""
    path = Path(path)
    data = data or DataConfig()
    if not path.is_file():
        raise ValueError(f"problem file {str(path)!r} does not exist ({DATA_TOOLS_HINT})")
    problems = [problem_from_row(where, row, data) for where, row in read_rows(path)]
    if not problems:
        raise ValueError(f"problem file {path} holds no rows")
    return problems


def load_split(data: DataConfig, split: str) -> list[PromptProblem]:
    return load_problems(split_file(data, split), data)
