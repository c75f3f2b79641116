"""docs/models.md's table of supported families is the tests' own: made again from the runs
the tests parametrize and compared, so a family or device count no test checks cannot appear."""

from __future__ import annotations

import pytest
from tests import supported_models


def test_the_page_holds_the_table_the_tests_make() -> None:
    text = supported_models.PAGE.read_text()
    assert text == supported_models.page(text), (
        "docs/models.md's table is out of date: python -m tests.supported_models"
    )


def test_every_checked_family_is_a_row_with_its_device_counts() -> None:
    table = supported_models.table()
    names = {**supported_models.NAMES, **supported_models.OTHER_NAMES}
    for family, kinds in supported_models.checked().items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {names[family]} |"))
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for kind, cell in zip(supported_models.KINDS, cells):
            for devices in kinds.get(kind, ()):
                assert str(devices) in cell, (family, kind, cell)


def test_a_family_without_a_name_is_refused(monkeypatch) -> None:
    monkeypatch.delitem(supported_models.OTHER_NAMES, "vit")
    with pytest.raises(ValueError, match=r"no display name for the families \['vit'\]"):
        supported_models.table()
