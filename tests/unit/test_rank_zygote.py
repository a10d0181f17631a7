"""The forked ranks of tests/rank_zygote.py behave as fresh ``python ARGS`` processes would.

Each test runs a few lines of plain Python as the ranks of a job (no Megatron work: the
zygotes are shared with the session's other jobs, so a test costs a fork, not an import).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.torchrun import REPO, run_torchrun


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_rank_sees_the_argv_path_cwd_env_and_name_of_python_running_its_script(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                          "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
                          "name": __name__}))
    """)
    result = run_torchrun(2, [str(script), "--flag", "value"], cwd=tmp_path)
    seen = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(s["rank"] for s in seen) == ["0", "1"]
    for record in seen:
        assert record["argv"] == [str(script), "--flag", "value"]
        assert record["path0"] == str(tmp_path.resolve())
        assert record["cwd"] == str(tmp_path.resolve())
        assert (record["world"], record["name"]) == ("2", "__main__")


def test_a_module_run_gets_the_working_directory_first_on_its_path(tmp_path):
    (tmp_path / "rank_module.py").write_text(
        "import os, sys\nprint(sys.path[0] == os.getcwd(), sys.argv[1:], __name__)\n")
    result = run_torchrun(1, ["-m", "rank_module", "a"], cwd=tmp_path)
    assert result.stdout.strip() == "True ['a'] __main__"


def test_a_ranks_exit_status_and_traceback_are_the_interpreters(tmp_path):
    exits = _script(tmp_path, "import sys\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match=r"exited 3 \(rank exit codes \[3\]\)"):
        run_torchrun(1, [str(exits)])
    raises = _script(tmp_path, "raise ValueError('from the rank')\n")
    with pytest.raises(AssertionError, match=r"(?s)exited 1 .*ValueError: from the rank"):
        run_torchrun(1, [str(raises)])


def test_a_failing_rank_stops_the_others(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "0":
            sys.exit(5)
        time.sleep(600)
    """)
    with pytest.raises(AssertionError, match=r"rank exit codes \[5, -9\]"):
        run_torchrun(2, [str(script)], timeout_s=120)


def test_the_ranks_of_a_job_hash_strings_with_their_own_seeds(tmp_path):
    # torchrun's ranks are fresh interpreters, each with its own random hash seed; forks of one
    # process would all share it and hide code whose collectives follow set order.
    # (A PYTHONHASHSEED in the environment fixes the seed of fresh interpreters too.)
    script = _script(tmp_path, "print(hash('megatron_logra'))\n")
    hashes = run_torchrun(2, [str(script)], cwd=REPO).stdout.split()
    assert len(hashes) == 2
    assert (hashes[0] != hashes[1]) == (os.environ.get("PYTHONHASHSEED", "random") == "random")
