"""Plain writing on every page of the site and the README: the prose outside code blocks,
tables and headings, split into sentences at `.`, `!` and `?` only (so a chain of clauses
joined by semicolons, colons or a list's items counts as one sentence), has a median of at
most 22 words and no sentence over 50. Both figures are reported (`record_property`).

Docstrings, which the API pages render, are not yet held to it."""

from __future__ import annotations

import re
import statistics

from tests.conftest import ROOT

FENCE = re.compile(r"^```.*?^```$", re.S | re.M)
MEDIAN, LONGEST = 22, 50


def _prose(text: str) -> str:
    """`text` without code blocks, table rows, headings and HTML comments; inline code and
    a link each read as the words they show."""
    text = FENCE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "#", ":::"))]
    text = "\n".join(lines)
    text = re.sub(r"`[^`]*`", "code", text)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def sentences(text: str) -> list[str]:
    parts = re.split(r"[.!?](?:\s|$)", _prose(text))
    return [" ".join(p.split()) for p in parts if p.split()]


def test_the_pages_are_written_in_short_sentences(record_property) -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    lengths: list[int] = []
    long: list[str] = []
    for page in pages:
        for sentence in sentences(page.read_text()):
            words = len(sentence.split())
            lengths.append(words)
            if words > LONGEST:
                long.append(f"{page.relative_to(ROOT)}: {words} words: {sentence[:100]}...")
    median = statistics.median(lengths)
    record_property("sentences", len(lengths))
    record_property("median_words", median)
    record_property("longest_words", max(lengths))
    assert len(lengths) > 300  # the pages were read
    assert median <= MEDIAN, f"the median sentence is {median} words (at most {MEDIAN})"
    assert not long, f"sentences over {LONGEST} words:\n" + "\n".join(long)


def test_a_chain_of_clauses_is_one_sentence() -> None:
    chained = (
        "It checks that:\n\n- a slice exists;\n- its ranks are known;\n- no two share a device\n"
    )
    assert len(sentences(chained)) == 1
    assert len(sentences("One. Two! Three?")) == 3
    assert sentences("| a table. | row. |\n```\ncode. more.\n```\n") == []
