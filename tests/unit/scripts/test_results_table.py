import json
import re

from scripts.bench import results_table

MAX_TOP_LEVEL_JSONS = 90


def test_results_md_is_what_the_jsons_give():
    """RESULTS.md cannot drift from the JSONs it cites: regenerate it after changing a row or a result."""
    committed = results_table.RESULTS_MD.read_text()
    assert committed == results_table.render() + "\n", "stale: run python scripts/bench/results_table.py"


def test_every_json_a_row_cites_is_at_the_top_level_of_the_results():
    missing = [name for name in results_table.cited_files() if not (results_table.RESULTS_DIR / name).is_file()]
    assert missing == []


def test_every_link_in_results_md_resolves():
    text = results_table.RESULTS_MD.read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    assert targets, "RESULTS.md links no result"
    missing = [target for target in targets if not (results_table.BENCH_DIR / target).exists()]
    assert missing == []


def test_the_top_level_of_the_results_stays_small():
    """Superseded runs go to benchmarks/results/archive/; the top level keeps what backs a current row."""
    assert len(list(results_table.RESULTS_DIR.glob("*.json"))) <= MAX_TOP_LEVEL_JSONS


def acceptance(ngpu: int, date: str, commit: str, rows: dict[str, str]) -> dict:
    return {
        "ngpu": ngpu,
        "date": date,
        "git_commit": commit,
        "device_name": "NVIDIA H200",
        "rows": [{"name": name, "status": status} for name, status in rows.items()],
    }


def test_acceptance_matrix_takes_the_newest_run_of_each_row_at_each_gpu_count(tmp_path, monkeypatch):
    runs = {
        "acceptance_old_ep2.json": acceptance(2, "2026-01-01T00:00:00", "aaaaaaa", {"base": "passed", "mtp": "failed"}),
        "acceptance_new_ep2.json": acceptance(
            2, "2026-02-01T00:00:00", "bbbbbbb", {"base": "passed", "mtp": "skipped"}
        ),
        "acceptance_one.json": acceptance(1, "2026-03-01T00:00:00", "ccccccc", {"mtp": "passed"}),
    }
    for name, result in runs.items():
        (tmp_path / name).write_text(json.dumps(result))
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "acceptance_newest.json").write_text(
        json.dumps(acceptance(2, "2027-01-01T00:00:00", "ddddddd", {"base": "failed"}))
    )
    monkeypatch.setattr(results_table, "RESULTS_DIR", tmp_path)

    # A skipped row is no run: the older failure stays the news; the archive is never read.
    assert results_table.acceptance_files() == {
        "base": {2: "acceptance_new_ep2.json"},
        "mtp": {2: "acceptance_old_ep2.json", 1: "acceptance_one.json"},
    }
    table = "\n".join(results_table.acceptance_table())
    mtp = next(line for line in table.splitlines() if line.startswith("| mtp |"))
    assert "passed at ccccccc" in mtp and "failed at aaaaaaa" in mtp and "| not run |" in mtp


def test_a_command_is_shown_as_a_user_reruns_it_today():
    """A row's command names the interpreter `python` and a renamed flag by its name today: the old name is refused."""
    result = {
        "command": "/opt/torch/.venv/bin/python ./run_train.sh --parallelism.deepep_sync_free_capacity_factor 1.2 "
        "--parallelism.deepep_sync_free_capacity_factor=1.5 --training.steps 14"
    }
    assert results_table.shown_command(result) == (
        "python ./run_train.sh --parallelism.expert_parallel_capacity_factor 1.2 "
        "--parallelism.expert_parallel_capacity_factor=1.5 --training.steps 14"
    )
