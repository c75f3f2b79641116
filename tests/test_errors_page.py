"""docs/reference/errors.md documents every error class tessel raises for the user (each
subclass of TesselError), and every message its troubleshooting table quotes is text tessel
writes, so the page can neither miss a class nor quote a message that no code says."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

from tests.conftest import ROOT

import tessel
from tessel.errors import TesselError

PAGE = ROOT / "docs" / "reference" / "errors.md"
SRC = ROOT / "src" / "tessel"


def _error_classes() -> set[str]:
    """Every subclass of TesselError defined in a module of tessel, by its dotted name."""
    found = set()
    for info in pkgutil.walk_packages(tessel.__path__, "tessel."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, TesselError)
                and value.__module__ == module.__name__
            ):
                found.add(f"{value.__module__}.{value.__qualname__}")
    return found


def test_every_error_class_has_a_row() -> None:
    rows = set(re.findall(r"^\| `(tessel\.[\w.]+)` \|", PAGE.read_text(), re.M))
    classes = _error_classes()
    assert "tessel.config.errors.ConfigError" in classes  # the walk finds them
    assert classes <= rows, f"not on {PAGE.name}: {sorted(classes - rows)}"
    assert rows <= classes, f"on {PAGE.name} but no TesselError: {sorted(rows - classes)}"


def test_every_quoted_message_is_tessels_own_text() -> None:
    section = PAGE.read_text().partition("## Troubleshooting, by message")[2]
    quoted = re.findall(r'^\| "([^"]+)" \|', section, re.M)
    assert len(quoted) >= 10
    source = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for message in quoted:
        assert message in source, f"{message!r} is not text tessel writes"
