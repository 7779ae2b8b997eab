"""scripts/benchmark_delta_rule.py: the kernel table and the --layers table, at a small length."""

import re
import subprocess
import sys

from helpers.paths import REPO

SCRIPT = REPO / "scripts" / "benchmark_delta_rule.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if re.match(r"\| \d", line)]


def test_kernels_table_with_the_token_by_token_check():
    done = run("--lengths", "128", "--repeat", "1", "--heads", "2", "--head-dim", "16", "--check-lengths", "128")
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = rows(done.stdout)
    assert row[0] == "128" and float(row[2]) > 0 and float(row[4]) > 0
    assert float(row[6]) < 1e-5  # the chunked kernel against the token-by-token one


def test_layers_table_times_both_block_kinds():
    done = run("--layers", "--lengths", "128", "--repeat", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "qwen3_5 debugmodel: dim 256" in done.stdout
    (row,) = rows(done.stdout)
    seconds = [float(re.match(r"[\d.]+", c).group()) for c in (row[1], row[3])]
    assert row[0] == "128" and min(seconds) > 0 and float(row[2]) > 0 and float(row[4]) > 0


def test_an_unknown_flavor_is_refused_with_exit_2():
    done = run("--layers", "--flavor", "huge", "--lengths", "128")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "huge" in done.stderr
