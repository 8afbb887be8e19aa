"""The docs stay true to the tree: docs/architecture.md's Folders names every package, and every pointer to a section of
BENCHMARKS.md or a page of docs/ (in code, comments and docs) names a file and a heading that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `BENCHMARKS.md, "Heading"`, `docs/cli.md "Heading"`: a pointer to a section by the start of its heading
SECTION = re.compile(r'(?P<file>[\w./-]*\b[\w-]+\.md),? "(?P<heading>[^"]+)"')
LINK = re.compile(r"\]\((?P<target>[^)\s#]+\.md)(?:#(?P<anchor>[^)\s]+))?\)")


def _tracked(*patterns: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).exists()]


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _layout() -> str:
    page = (ROOT / "docs" / "architecture.md").read_text()
    return page.split("## Folders", 1)[1].split("```")[1]


def test_the_layout_names_every_package_and_top_level_folder():
    layout = _layout()
    named = {line.split()[0] for line in layout.splitlines() if line.strip() and not line.startswith(" ")}
    packages = {
        f"{path.parent.relative_to(ROOT)}/"
        for path in _tracked("runtime/**/__init__.py", "depctl/**/__init__.py", "runtime/__init__.py")
    }
    folders = {f"{p.parts[len(ROOT.parts)]}/" for p in _tracked() if len(p.relative_to(ROOT).parts) > 1}
    folders -= {".ci/"}
    wanted = (packages - {"depctl/cli/"}) | {f for f in folders if not f.startswith(".")}
    missing = sorted(wanted - named)
    assert not missing, f"docs/architecture.md's Folders does not name {missing}"
    assert "depctl/cli/" in packages and "cli/" in layout  # the CLI is named on depctl/'s line


def _pointers():
    files = _tracked("*.py", "*.md", "*.cpp", "*.sh")
    for path in files:
        if "fake_vllm" in path.parts or path == Path(__file__).resolve():  # (this file's examples)
            continue
        text = path.read_text(errors="replace")
        for match in SECTION.finditer(text):
            yield path, match.group("file"), match.group("heading"), None
        for match in LINK.finditer(text):
            target = match.group("target")
            if not target.startswith(("http://", "https://")):
                yield path, target, None, match.group("anchor")


def _resolve(source: Path, name: str) -> Path | None:
    for candidate in (source.parent / name, ROOT / name, ROOT / "docs" / name):
        if candidate.exists():
            return candidate
    return None


@pytest.mark.parametrize("source,name,heading,anchor", list(_pointers()), ids=lambda v: str(v)[-40:])
def test_every_pointer_to_a_doc_section_finds_it(source, name, heading, anchor):
    target = _resolve(source, name)
    where = source.relative_to(ROOT)
    assert target is not None, f"{where} points to {name}, which does not exist"
    headings = _headings(target)
    if heading is not None:
        assert any(h.startswith(heading) for h in headings), f'{where} points to {name}, "{heading}": no such heading'
    if anchor is not None:
        assert anchor in {_anchor(h) for h in headings}, f"{where} links to {name}#{anchor}: no such heading"


def test_code_names_the_section_it_points_to():
    # "BENCHMARKS.md has the numbers" outlives the section it meant; a named section is checked above
    vague = []
    for path in _tracked("runtime/*", "depctl/*", "benchmarks/*", "scripts/*"):
        if path.suffix not in (".py", ".cpp", ".sh"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in re.finditer(r"BENCHMARKS\.md", line):
                if not re.match(r',? "', line[match.end() :]):
                    vague.append(f"{path.relative_to(ROOT)}:{number}")
    assert not vague, f"these point to BENCHMARKS.md without naming a section: {vague}"
