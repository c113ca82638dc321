"""README.md and docs/ are reference, not a diary: no commit hashes, no periods of work
named by ordinal ("the twelfth session"), no dated log headings, no "now" or "last time".
History lives in git; a document says what exists, why, and the current figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
HEX = re.compile(r"(?<![\w/.\-])[0-9a-f]{7,40}(?![\w/.\-])")


def _commit_hashes(line: str) -> list[str]:
    """Hex words of 7-40 characters with both a digit and a letter: what `git log` prints."""
    return [w for w in HEX.findall(line) if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)]


BUILD_LOG = {
    "a period of work ('session')": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "an ordinal decision label ('Decision (twelfth ...)')": re.compile(
        rf"\bdecision\s*\((?:{ORDINALS})\b|\((?:{ORDINALS})\s+(?:session|period|round|pass)\b",
        re.IGNORECASE,
    ),
    "'now' (say what is, not when it changed)": re.compile(r"\bnow\b", re.IGNORECASE),
    "'last time' / 'this time' / 'next time'": re.compile(
        r"\b(?:last|this|next) time\b", re.IGNORECASE
    ),
    "a commit named ('previous commit', 'HEAD')": re.compile(
        r"\b(?:previous|earlier|older|new) commits?\b|\bHEAD\b"
    ),
    "an earlier version ('the earlier code', 'before the fix')": re.compile(
        r"\b(?:earlier|old|previous) (?:code|version|rules?|model's figures|figures)\b"
        r"|\bbefore (?:the|this|that) (?:fix|fixes|change|changes|rework)\b",
        re.IGNORECASE,
    ),
}
DATED_HEADING = re.compile(r"^#{1,6} .*\b20\d\d-\d\d-\d\d\b")


def findings(text: str) -> list[str]:
    """Every build-log phrase in ``text``, as ``line N: what: the line``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if DATED_HEADING.search(line):
            found.append(f"line {number}: a dated log heading: {line.strip()}")
        if hashes := _commit_hashes(line):
            found.append(f"line {number}: commit hash {hashes}: {line.strip()}")
        for what, pattern in BUILD_LOG.items():
            if pattern.search(line):
                found.append(f"line {number}: {what}: {line.strip()}")
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_build_log_language(document: Path) -> None:
    found = findings(document.read_text())
    assert found == [], f"{document.relative_to(REPO)}:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "## 2026-11-24, tenth session (no GPU lent)",
        "Decision (twelfth session): one drift per occupancy.",
        "Fixed in e68a9e6: a queued time stands in.",
        "the previous commit (`350db76`) and the new code",
        "The gateway now re-reads the state.",
        "measured last time at 0.73",
        "with the earlier code the ratio was 1.1",
        "before the fix the bench waited",
        "### Placement (2026-11-23)",
    ],
)
def test_each_kind_of_build_log_phrase_is_found(text: str) -> None:
    assert findings(text) != []


@pytest.mark.parametrize(
    "text",
    [
        "`retouch bench load --model retouch:small-flux --rate 0.18` on 2026-11-24 (2 cores).",
        "a profile under profiles/605c481e7b702589e57eca1d57455b346b087bf4ae405d0590823240e38583fc-cpu.json",
        "fp8 (e4m3) K and V; 1e-4 guidance; 0.9997 of accepted within the SLO",
        "The first edit of an image runs stock; the second is mask-aware.",
        "## Production shapes on a GPU",
    ],
)
def test_reference_text_passes(text: str) -> None:
    assert findings(text) == []
