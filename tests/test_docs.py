"""The docs stand on their own: every relative link of README.md and docs/*.md names a file of
the repository (and a heading of it, GitHub's anchor rule), and the README keeps its two
set-up commands and its 400-line budget."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text):
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def _anchors(path):
    out, seen, code = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            code = not code
            continue
        m = None if code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page):
    bad = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        full = (page.parent / path).resolve() if path else page
        if ROOT not in full.parents and full != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not full.exists():
            bad.append(f"{target}: no such file")
        elif anchor and full.suffix == ".md" and anchor not in _anchors(full):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, bad


def test_readme_budget_and_set_up_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    assert "make demo" in text and "make test" in text


def test_no_file_cites_a_document_outside_the_repository():
    """issue 65, 9: a reader of the repository has no SPEC; every formula and decision is cited
    by the repository's own docs (docs/math.md's sections), never by a file outside it."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    bad = []
    pattern = re.compile(r"\bSPEC\b(?:\s*§|\s+section|\.md)|\.\./shared/|shared/SPEC")
    for name in files:
        path = ROOT / name
        if name == "tests/test_docs.py" or path.suffix not in (
                ".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".cpp", ".h", ".yaml", ""):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        bad += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1)
                if pattern.search(line)]
    assert not bad, f"cites a file outside the repository: {bad}"
