"""Convert math datasets on local disk into problem files ``megatron-logra sft`` / ``rl`` read.

    python tools/prepare_dataset.py gsm8k IN_DIR OUT_DIR   # GSM8K: question, answer "... #### 72"
    python tools/prepare_dataset.py math  IN_DIR OUT_DIR   # MATH / DeepScaleR: problem, solution
                                                           # with \\boxed{...} (or an answer field)
    python tools/prepare_dataset.py verl  IN_DIR OUT_DIR   # verl Parquet: prompt (messages),
                                                           # reward_model.ground_truth

IN_DIR holds the dataset's files as it is distributed (searched recursively): JSONL, a JSON list
or Parquet shards whose names start with the split (``train.jsonl``, ``test-00000-of-00001.parquet``,
``deepscaler.json``: a file without a split name is the training split). Nothing is downloaded.

OUT_DIR gets ``train.jsonl`` and, when the source has one, ``test.jsonl``: one row per problem
with ``prompt`` (the question; verl's messages list as it is), ``answer`` (the reference answer
the math-verify reward grades against) and ``solution`` (a worked solution ending in
``\\boxed{answer}``, the supervised target with ``data.response_key=solution``). GSM8K's
calculator annotations (``<<48/2=24>>``) are dropped and its ``#### 72`` line becomes
``The final answer is \\boxed{72}.``. The directory is written next to its final place and
renamed into it; an existing non-empty OUT_DIR is refused.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPLITS = ("train", "test")
SUFFIXES = (".jsonl", ".json", ".parquet")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    depth, begin = 0, text.index("{", start)
    for at in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        if depth == 0:
            return text[begin + 1 : at]
    return None


def _field(where: str, row: dict[str, Any], key: str) -> Any:
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{where}: no field {key!r} (the row has {sorted(row)})")
        node = node[part]
    return node


def _gsm8k(where: str, row: dict[str, Any]) -> dict[str, Any]:
    question, answer = _field(where, row, "question"), _field(where, row, "answer")
    reasoning, marker, final = str(answer).rpartition("####")
    if not marker:
        raise ValueError(f"{where}: answer {answer!r:.80} has no '#### N' line")
    final = final.strip().replace(",", "")
    steps = _CALCULATOR.sub("", reasoning).strip()
    return {"prompt": question, "answer": final,
            "solution": f"{steps}\nThe final answer is \\boxed{{{final}}}."}


def _math(where: str, row: dict[str, Any]) -> dict[str, Any]:
    problem, solution = _field(where, row, "problem"), row.get("solution")
    answer = row.get("answer")
    if answer is None:
        boxed = last_boxed(str(solution or ""))
        if boxed is None:
            raise ValueError(f"{where}: no 'answer' field and no \\boxed{{}} in the solution")
        answer = boxed
    answer = str(answer)
    if not solution or last_boxed(str(solution)) is None:
        # DeepScaleR-style rows whose solution does not box the answer: box it at the end.
        solution = f"{solution or ''}\nThe final answer is \\boxed{{{answer}}}.".strip()
    return {"prompt": problem, "answer": answer, "solution": solution}


def _verl(where: str, row: dict[str, Any]) -> dict[str, Any]:
    prompt = _field(where, row, "prompt")
    if not isinstance(prompt, (str, list)):
        raise ValueError(f"{where}: prompt is a {type(prompt).__name__}, expected messages")
    out = {"prompt": prompt, "answer": str(_field(where, row, "reward_model.ground_truth"))}
    if "data_source" in row:
        out["data_source"] = row["data_source"]
    return out


CONVERTERS: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "gsm8k": _gsm8k, "math": _math, "verl": _verl}


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {number}", row
    elif path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path} holds a JSON {type(rows).__name__}, not a list of rows")
        for number, row in enumerate(rows, 1):
            yield f"{path} row {number}", row
    else:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    yield f"{path}:{number}", json.loads(line)


def split_files(in_dir: Path) -> dict[str, list[Path]]:
    """The source files of each split: names starting with the split; files naming no split are
    the training split (when no file names it)."""
    files = sorted(p for p in in_dir.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    found = {split: [p for p in files if p.name.startswith(split)] for split in SPLITS}
    if not found["train"]:
        found["train"] = [p for p in files if not any(p.name.startswith(s) for s in SPLITS)]
    if not found["train"]:
        raise ValueError(f"{in_dir} holds no training file ({', '.join(SUFFIXES)} whose name "
                         "starts with 'train', or one naming no split)")
    return found


def prepare(kind: str, in_dir: Path, out_dir: Path) -> dict[str, int]:
    """Write OUT_DIR's split files; returns the rows written per split."""
    if not in_dir.is_dir():
        raise ValueError(f"input directory {str(in_dir)!r} does not exist")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {str(out_dir)!r} exists and is not empty")
    convert = CONVERTERS[kind]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    counts = {}
    try:
        for split, paths in split_files(in_dir).items():
            if not paths:
                continue
            rows = [convert(where, row) for path in paths for where, row in _rows(path)]
            (staging / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            counts[split] = len(rows)
        staging.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("kind", choices=sorted(CONVERTERS))
    parser.add_argument("in_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        counts = prepare(args.kind, args.in_dir, args.out_dir)
    except (ValueError, json.JSONDecodeError) as error:
        print(f"prepare_dataset: error: {error}", file=sys.stderr)
        return 2
    written = ", ".join(f"{split}.jsonl ({n} rows)" for split, n in counts.items())
    print(f"prepare_dataset: wrote {args.out_dir}: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
