"""benchmarks/op_counts.py: no memory kind's training step, and not the Memoria engine's step,
dispatches more aten operations than the committed figures (benchmarks/op_counts.json) allow.

A count, not a timing: on a GPU each operation is a kernel launch, so a rise here is a slower
host-bound step there, which no CPU timing in CI would notice.
"""

from __future__ import annotations

import pytest
import torch

from bench_util import load_benchmark

bench = load_benchmark("op_counts.py", "op_counts_bench")
CI_GROUPS = ["ci", "engine"]


@pytest.fixture(scope="module")
def counted():
    """Counted in this process: tests/conftest.py puts torch's `F.linear` back after every file (a ZeRO-3
    engine made in a test's process replaced it for good, and `nn.Linear` then dispatched `mm` + `add_`
    for `addmm` here, on a pytest-xdist worker)."""
    return bench.count(CI_GROUPS)


def test_no_kind_and_not_the_engine_dispatches_more_operations_than_recorded(counted):
    figures = bench.load_figures()
    missing = [g for g in CI_GROUPS if g not in figures["counts"]]
    assert not missing, f"{bench.FIGURES} has no group {missing}: run `{bench.COMMAND}`"
    rises, _ = bench.compare(figures["counts"], counted)
    assert not rises, (
        "operation counts rose beyond the margin (2% or 5 ops):\n  " + "\n  ".join(rises)
        + f"\nfewer operations is the fix; a rise that is intended is recorded with `{bench.COMMAND}`"
    )


def test_the_counts_do_not_depend_on_a_second_run_or_the_threads(counted):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        again = {"ci": {"memoria": bench.count_model_step("memoria", "ci")},
                 "engine": {"small": bench.count_engine_step("small")}}
    finally:
        torch.set_num_threads(threads)
    assert again["ci"]["memoria"] == counted["ci"]["memoria"]
    assert again["engine"]["small"] == counted["engine"]["small"]


def test_an_extra_operation_in_a_kinds_step_fails_the_check(counted, monkeypatch):
    from memoria_ds.model.recurrent.xl import XLKind

    real_write = XLKind.write

    def write(self, memory, read, pending, writes, hidden, valid):  # eight more operations: over the margins
        for _ in range(8):
            valid.clone()
        return real_write(self, memory, read, pending, writes, hidden, valid)

    monkeypatch.setattr(XLKind, "write", write)
    now = {"ci": {"xl": bench.count_model_step("xl", "ci")}}
    assert now["ci"]["xl"]["ops"] == counted["ci"]["xl"]["ops"] + 8
    rises, _ = bench.compare({"ci": {"xl": counted["ci"]["xl"]}}, now)
    assert len(rises) == 2 and rises[0].startswith("ci xl: ops rose") and rises[1].startswith("ci xl: compute rose")
    assert "most risen: clone +8" in rises[0]


def test_the_margin_is_two_percent_or_five_operations_and_a_fall_asks_for_write():
    assert bench.allowed_rise(100) == 5 and bench.allowed_rise(1000) == 20 and bench.allowed_rise(1001) == 21
    was = {"g": {"k": {"ops": 1000, "compute": 100, "by_op": {"mm": 100}}}}
    within = {"g": {"k": {"ops": 1020, "compute": 105, "by_op": {"mm": 105}}}}
    assert bench.compare(was, within) == ([], [])
    over = {"g": {"k": {"ops": 1021, "compute": 90, "by_op": {"mm": 90, "view": 931}}}}
    rises, notes = bench.compare(was, over)
    assert rises == ["g k: ops rose 1000 -> 1021 (+21, +2.1%; margin 20); most risen: view +931"]
    assert notes == ["g k: compute fell 100 -> 90"]
    rises, _ = bench.compare(was, {"g": {"new": over["g"]["k"]}})
    assert rises == [f"g new: not in op_counts.json; record it: {bench.COMMAND}"]


def test_write_records_the_counts_and_the_check_exits_1_on_a_rise(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "ENGINE_SIZES", {"small": bench.ENGINE_SIZES["small"]})  # the cheapest count
    path = tmp_path / "op_counts.json"
    assert bench.main(["--groups", "engine", "--write", "--figures", str(path)]) == 0
    figures = bench.load_figures(path)
    assert figures["command"] == bench.COMMAND and figures["torch"] == torch.__version__ and figures["date"]
    assert set(figures["counts"]) == {"engine"} and set(figures["counts"]["engine"]) == {"small"}
    assert bench.main(["--groups", "engine", "--figures", str(path)]) == 0
    figures["counts"]["engine"]["small"]["ops"] -= 10
    path.write_text(__import__("json").dumps(figures))
    capsys.readouterr()
    assert bench.main(["--groups", "engine", "--figures", str(path)]) == 1
    out = capsys.readouterr().out
    assert "engine small: ops rose" in out and bench.COMMAND in out
