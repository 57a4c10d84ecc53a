"""tools/docs/results.py: the docs' results tables come from docs/results/*.jsonl."""
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_results", ROOT / "tools" / "docs" / "results.py")
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def _page(tmp_path, name, body):
    (tmp_path / "results").mkdir(exist_ok=True)
    page = tmp_path / "p.md"
    page.write_text(f"# Page\n\n<!-- results:{name} -->\nold table\n<!-- /results -->\n\n{body}\n")
    return page


def test_a_table_is_rendered_from_its_records_and_checked(tmp_path):
    page = _page(tmp_path, "allreduce", "after")
    rows = [{"bench": "allreduce-rounds", "mpi": "MPICH 5.0.2", "np": 2, "bytes": 1 << 20,
             "algo": "shm", "hpcdp_time_s": 2e-4, "native_time_s": 1.5e-4, "ratio_median": 0.75,
             "ratios": [0.75, 0.7, 0.8], "bound": 1.0, "held": 0, "holds": False},
            {"bench": "other"}]
    (tmp_path / "results" / "allreduce-rounds.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert results.main(["--docs", str(tmp_path), "--check"]) == 1
    assert results.main(["--docs", str(tmp_path)]) == 0
    text = page.read_text()
    assert "| MPICH 5.0.2 | 2 | 1 MiB | shm | 200 | 150 | 0.75 | 0.75 0.70 0.80 | 1 | 0 | no |" in text
    assert "old table" not in text and text.endswith("after\n") and "MPI: MPICH 5.0.2." in text
    assert "tools/bench/allreduce.sh" in text  # the command that writes the file
    assert results.main(["--docs", str(tmp_path), "--check"]) == 0


def test_an_unknown_table_name_is_an_error(tmp_path):
    _page(tmp_path, "no-such-table", "")
    assert results.main(["--docs", str(tmp_path)]) == 2


def test_every_spec_has_its_table_and_file_and_the_docs_are_current():
    pages = {p: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    used = [n for text in pages.values() for n in results.markers(text)]
    assert sorted(used) == sorted(results.SPECS), "each spec renders exactly one table"
    for name, spec in results.SPECS.items():
        assert (ROOT / "docs" / "results" / spec["file"]).exists(), name
    assert results.main(["--check"]) == 0, "run python tools/docs/results.py"


def test_no_page_carries_clock_times_of_runs():
    for page in (ROOT / "docs").glob("*.md"):
        assert not re.search(r"\d{2}:\d{2}(-\d{2}:\d{2})? UTC", page.read_text()), page.name
