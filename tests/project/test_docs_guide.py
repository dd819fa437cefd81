"""docs/ is a guide, not a log: docs/README.md is its index and links every page; no page
narrates the project's history (dated measurement logs, "previously", "before this change"):
those live in results/, one record per measurement campaign next to its CSV or log, and each
record names the git commit, the machine and the command that made it."""
from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
"""A dated log entry: "(2026-12-01", "measured 2026-12-01", "2026-12-01T06:03" ..."""
CITATION = re.compile(r"https?://|\b[\w-]+\.(?:ch|com|ai|org|io|net)\b|\b(?:post|blog|article|published|lmsys)\b", re.I)
"""... unless the line cites a published source (a blog post's date is how it is found)."""

NARRATION = [
    re.compile(r"\bbefore this change\b", re.I),
    re.compile(r"\bpreviously\b", re.I),
    re.compile(r"\b(?:it|we|this|that|they|which|there|one) used to\b", re.I),
    # "an earlier run", "in earlier measurements", "earlier versions of the code" (how-to uses such
    # as "killed at an earlier update" stay allowed)
    re.compile(r"\bearlier (?:runs?|measurements?|versions?|commits?|releases?|implementations?|designs?|code"
               r"|tables?|numbers?|figures?|results?)\b", re.I),
    re.compile(r"\b(?:ran|measured|run|reported|shown|written) earlier\b", re.I),
    # "Then (issue 12)", "then (2026-...", "before issue 43", "since commit abc1234"
    re.compile(r"\bthen \((?:issue|commit|git|20\d\d)", re.I),
    re.compile(r"\b(?:before|after|since|until) (?:issue|commit) [\w#]+", re.I),
    re.compile(r"\bafter (?:a|the) fix\b", re.I),
]

ISSUE = re.compile(r"\bissues? \d+", re.I)
"""The project's issue numbers date a page ("(issue 43)", "before issue 26", "issue 15, 8"); a
guide points to a results/ record instead. A source cited as ``owner/repo issue #N`` is not
history and stays allowed. Checked on the written pages, not on CLI.md and API.md, which quote
the code's help texts and docstrings."""
GENERATED_PAGES = {"CLI.md", "API.md"}  # scripts/gen_docs.py

GENERATED_RECORDS = {"results/summary.md"}  # written by `weight-transfer analyze`
KEY = re.compile(r"^\s*(?:[-*]\s+)?(?:\*\*)?([A-Za-z][A-Za-z /]*?)\s*:", re.M)


def test_the_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(\.?/?([A-Za-z_]+\.md)(?:#[^)]*)?\)", index))
    missing = [p for p in PAGES if p not in linked]
    assert not missing, f"docs/README.md does not link {missing}"
    dead = sorted(p for p in linked if not (DOCS / p).exists())
    assert not dead, f"docs/README.md links pages that do not exist: {dead}"


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_no_page_narrates_history(page):
    hits = []
    for i, line in enumerate((DOCS / page).read_text().splitlines(), 1):
        m = DATE.search(line)
        if m and not CITATION.search(line):
            hits.append(f"docs/{page}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}")
        m = ISSUE.search(line) if page not in GENERATED_PAGES else None
        if m:
            hits.append(f"docs/{page}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}")
        for pat in NARRATION:
            m = pat.search(line)
            if m:
                hits.append(f"docs/{page}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not hits, ("history belongs in a results/ record, not in docs/:\n" + "\n".join(hits))


def records():
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "results").rglob("*.md")
                  if p.relative_to(ROOT).as_posix() not in GENERATED_RECORDS)


def test_there_are_records():
    assert records()


@pytest.mark.parametrize("rel", records())
def test_every_record_names_commit_machine_and_command(rel):
    head = "\n".join((ROOT / rel).read_text().splitlines()[:30])
    keys = [k.lower() for k in KEY.findall(head)]
    for want in ("commit", "machine", "command"):
        assert any(want in k for k in keys), f"{rel}: no '{want}:' line in its first 30 lines"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_every_relative_link_resolves(page):
    path, dead = DOCS / page, []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (DOCS / file).resolve() if file else path
        if not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(f"{target} (no such heading)")
    assert not dead, f"docs/{page}: dead links {dead}"
