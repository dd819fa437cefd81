"""The README's results table is generated: between ``<!-- results-table:begin -->`` and
``<!-- results-table:end -->`` it must be exactly what ``weight-transfer report``
(:mod:`weight_transfer.experiments.readme_table`) prints from the committed CSVs under
``results/``. A new row in one of those CSVs (a rerun of its command) changes the table: rerun
``weight-transfer report`` and paste its output between the markers."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT
from weight_transfer.experiments import readme_table
from weight_transfer.experiments.readme_table import BEGIN, END, GROUPS
from weight_transfer.experiments.readme_table import readme_table as table_in

README = ROOT / "README.md"


def test_the_readme_table_is_what_weight_transfer_report_prints():
    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "one results table between the markers"
    want = readme_table.table(ROOT)
    assert table_in(text) == want, (
        "README.md's results table differs from `weight-transfer report` on the committed CSVs; "
        "paste this between the markers:\n" + want)


def test_every_row_group_reads_a_committed_csv_and_names_its_command():
    tracked = set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    table = readme_table.table(ROOT)
    for g in GROUPS:
        assert (ROOT / g.csv).is_file(), g.csv
        if tracked:  # a git checkout: the CSV is committed (or added), not a local leftover of results/runs/
            assert g.csv in tracked or not g.csv.startswith("results/runs/"), g.csv
        assert f"`{g.command}`" in table and f"`{g.csv}`" in table
        assert g.command.startswith("weight-transfer ")


def test_the_command_prints_the_table():
    p = subprocess.run([sys.executable, "-m", "weight_transfer.experiments", "report"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == readme_table.table(ROOT)


def test_a_missing_csv_is_one_error_line(tmp_path):
    assert readme_table.main(["--root", str(tmp_path)]) == 2


def test_the_result_sentences_cite_numbers_the_table_shows():
    """The README's "result, in two sentences" paragraph: every number with a decimal point or a
    thousands separator in it is a cell of the generated table."""
    text = README.read_text()
    para = text.split("**The result, in two sentences**", 1)[1].split("\n\n", 1)[0]
    cited = re.findall(r"\d{1,3}(?:,\d{3})+|\d+\.\d+", para)
    assert len(cited) >= 5, para
    cells = {c.strip().split(" ")[0] for line in readme_table.table(ROOT).splitlines() for c in line.split("|")}
    notes = readme_table.table(ROOT)
    missing = [n for n in cited if n not in cells and f"{n} s" not in notes]
    assert not missing, f"numbers in the result sentences that the table does not show: {missing}"
