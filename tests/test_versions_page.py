"""docs/reference/versions.md lists exactly the pins of constraints.txt, each at its version."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.partition("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name] = version
    return pins


def test_the_page_lists_every_pin_at_its_version() -> None:
    page = (ROOT / "docs" / "reference" / "versions.md").read_text()
    listed = dict(re.findall(r"^\| `([\w.\-]+)` \| `([^`]+)` \|", page, re.M))
    pins = _pins()
    assert "torch" in pins and pins["torch"] == "2.13.0"
    assert listed == pins
