"""Docs say what is; results say what was measured (issue 48).

A date marks a measurement or a change, and both have their own place: a dated measurement
lives in a file under ``results/`` (with its command, machine, load and commit), a change that
moved a number is a dated line of ``CHANGELOG.md``. README.md and the pages of ``docs/`` say how
the code behaves now, so no date appears in them, ISO (``2026-11-27``) or with a month's name
(``27 November 2026``, ``Nov 27``). Every relative link of those pages, of ``results/`` and of
the changelog points at a file that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December"
           "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
DATE = re.compile(
    r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"  # 2026-11-27
    rf"|\b(?:{_MONTHS})\.? \d{{1,2}}(?:st|nd|rd|th)?\b(?:,? (?:19|20)\d\d)?"  # Nov 27, November 27th 2026
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)? (?:{_MONTHS})\b"  # 27 November
    rf"|\b(?:{_MONTHS}) (?:19|20)\d\d\b"  # November 2026
)


def dates_in(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in DATE.finditer(text)]


def test_the_pattern_finds_each_form_and_nothing_else():
    found = [d for _, d in dates_in("on 2026-11-27, on Nov 27, 27 November 2026, in December 2026;"
                                    " May 2026 and march 3")]
    assert found == ["2026-11-27", "Nov 27", "27 November", "December 2026", "May 2026"]
    assert not dates_in("lr 2e-3, EM 0.538, steps 2026-11, 64 MiB, may 3 rows, version 2.0, seed 1234")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_date_in_readme_or_docs(page):
    found = dates_in(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)} carries dates {found}: a dated measurement goes to results/, "
                       "a change that moved a number to a dated line of CHANGELOG.md; the page says how the code "
                       "behaves and links there")


def test_results_and_changelog_exist_and_carry_dates():
    results = sorted((ROOT / "results").glob("*.md"))
    assert results, "no results/*.md"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    entries = [line for line in changelog.splitlines() if line.startswith("- ")]
    assert entries and all(re.match(r"- \d{4}-\d\d-\d\d\b", line) for line in entries), \
        "every CHANGELOG.md entry starts with its date"


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [*PAGES, *sorted((ROOT / "results").glob("*.md")), ROOT / "CHANGELOG.md"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files {missing}"


# -- a measured number in a concept or how-to page links to its results file -----------------

# What marks a sentence as reporting a measurement: the word "measured", a throughput, a
# speed-up, or how long something took. Such a sentence must also carry a number (a decimal,
# a power of ten, or a count with a unit) to count: "peak memory has not been measured" is not
# a result. Estimates and other projects' figures ("expected", "nominal", "reported
# elsewhere") are not this project's measurements.
_MARK = re.compile(
    r"\bmeasured\b"
    r"|\d[\d.,]*\s*(?:tokens/s|tok/s|steps/s|samples/s|it/s|[GMK]B/s|rows/s)"
    r"|\b\d+(?:\.\d+)?\s*x (?:faster|slower|the speed|as fast)"
    r"|\b(?:took|takes|ran in|finished in|in about)\s+(?:about\s+)?\d+(?:\.\d+)?\s*"
    r"(?:ms|s|sec|seconds|min|minutes|h|hours)\b",
    re.I)
_NUMBER = re.compile(r"\b\d+\.\d+|\b\d+(?:\.\d+)?e-?\d+\b|\b\d+(?:\.\d+)?\s*(?:%|x\b|ms\b|s\b|min\b|[KMG]i?B\b|nats\b)")
_NOT_OURS = re.compile(r"\b(?:expected|estimated?|nominal|reported elsewhere)\b", re.I)
MEASUREMENT_PAGES = [ROOT / "docs" / "quickstart.md", *sorted((ROOT / "docs" / "concepts").glob("*.md")),
                     *sorted((ROOT / "docs" / "how-to").glob("*.md"))]


def unlinked_measurements(text: str) -> list[str]:
    """The sentences of ``text`` that report a measured number in a paragraph (a table is one)
    without a link into results/."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found = []
    for para in re.split(r"\n\s*\n", text):
        if "results/" in para:
            continue
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(`*])|\n(?=\|)", para):
            if _MARK.search(sentence) and _NUMBER.search(sentence) and not _NOT_OURS.search(sentence):
                found.append(" ".join(sentence.split())[:160])
    return found


def test_the_measurement_rule_flags_numbers_and_nothing_else():
    assert unlinked_measurements("Packing measured 2.73x on long tails.")
    assert unlinked_measurements("The demo took 4 min on 2 cores.")
    assert unlinked_measurements("| a | b |\n|---|---|\n| 1.2 GB/s | x |")
    assert not unlinked_measurements("Packing measured 2.73x ([results/packing.md](../../results/packing.md)).")
    assert not unlinked_measurements("Peak memory during a sync has not been measured here.")
    assert not unlinked_measurements("The expected sync is 61 GB / 45 GB/s = 1.4 s.")
    assert not unlinked_measurements("```\nmeasured 2.5 s\n```\nNo number here.")


@pytest.mark.parametrize("page", MEASUREMENT_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_measured_numbers_link_to_their_results_file(page):
    found = unlinked_measurements(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)} reports measured numbers without a link to results/ in the same "
                       f"paragraph: {found}. Move the measurement to its results file (command, machine, load, "
                       "commit) and link it, or link the file that holds it")
