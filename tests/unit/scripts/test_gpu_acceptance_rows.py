"""The acceptance harness's row selection: asking for a row runs the rows it needs, and a row whose needs did not
pass fails without launching a run."""

import pytest

from scripts.bench import gpu_acceptance as acceptance


def _names(rows):
    return [row.name for row in rows]


def test_a_row_brings_what_it_needs_in_table_order():
    rows = acceptance.all_rows()
    assert _names(acceptance.select_rows(rows, ["hf_export_import"])) == [
        "base", "checkpoint_save", "checkpoint_resume", "hf_export_import"
    ]  # fmt: skip
    assert _names(acceptance.select_rows(rows, ["eager", "memory_budget"])) == [
        "base", "full_ac", "memory_budget", "eager"
    ]  # fmt: skip


def test_needs_name_earlier_rows():
    names = _names(acceptance.all_rows())
    for row in acceptance.all_rows():
        assert all(names.index(need) < names.index(row.name) for need in row.needs), row.name


def test_unknown_row_is_an_error():
    with pytest.raises(SystemExit, match="unknown rows \\['nope'\\]"):
        acceptance.select_rows(acceptance.all_rows(), ["nope"])


def test_a_row_whose_needs_failed_fails_without_running(monkeypatch):
    monkeypatch.setattr(acceptance, "train_and_measure", lambda *a, **k: pytest.fail("launched a run"))
    rows = {row.name: row for row in acceptance.select_rows(acceptance.all_rows(), ["memory_budget"])}
    rows["base"].result = {"status": "passed"}
    rows["full_ac"].result = {"status": "failed"}

    class Opts:
        ngpu, flavor, steps, warmup_steps = 1, "16B_accept", 8, 3

    result = acceptance.run_row(rows["memory_budget"], rows, [], Opts, 1, None)
    assert result == {"status": "failed", "reason": "needs full_ac to pass first"}
