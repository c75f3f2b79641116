"""The supported-models table of docs/models.md, made from the runs the tests parametrize, so
the page cannot claim a family or a device count that no test checks.

A family's inference devices are the differential suite's runs against the eager model, its
training devices those of the training tests against torch's own AdamW, its generation devices
those of the tests against `transformers`' own `generate`. `python -m tests.supported_models`
writes the table into the page; tests/test_supported_models.py makes it again and compares.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from tests.conftest import ROOT
from tests.differential import test_families as inference
from tests.generation_families import NAMES
from tests.training import test_product, test_training

PAGE = ROOT / "docs" / "models.md"
BEGIN = "<!-- the table below is made by tests/supported_models.py -->"
END = "<!-- end of the table -->"
# the families the generation tests do not name
OTHER_NAMES = {"bert": "BERT", "vit": "ViT"}
KINDS = ("inference", "training", "generation")


def checked() -> dict[str, dict[str, set[int]]]:
    """family -> {"inference" | "training" | "generation": the device counts its tests run}."""
    from tests import test_generate, test_generate_families

    seen: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for family, devices, _, _ in inference.RUNS:
        seen[family]["inference"].add(devices)
    for family, devices, _ in test_generate_families.RUNS:
        seen[family]["generation"].add(devices)
    encoder_decoder = test_generate.test_an_encoder_decoder_generates_transformers_tokens
    (runs,) = [m.args[1] for m in encoder_decoder.pytestmark if m.name == "parametrize"]
    seen["t5"]["generation"].update(devices for devices, *_ in runs)
    for name, devices, *_ in test_training.CASES:
        seen[name]["training"].add(devices)
    for name in test_product.MODELS:
        for devices, *_ in (*test_product.MESHES, *test_product.REPLICATED):
            seen[name]["training"].add(devices)
    return seen


def table() -> str:
    names = {**NAMES, **OTHER_NAMES}
    families = checked()
    unnamed = sorted(set(families) - set(names))
    if unnamed:
        raise ValueError(f"supported_models: no display name for the families {unnamed}")
    lines = [
        "| family | inference, against the eager model | training, against torch | "
        "generation, against `transformers`' `generate` |",
        "|---|---|---|---|",
    ]
    for family in sorted(families, key=lambda f: names[f].lower()):
        cells = [_devices(families[family].get(kind)) for kind in KINDS]
        lines.append(f"| {names[family]} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _devices(counts: set[int] | None) -> str:
    if not counts:
        return ""
    counts_text = ", ".join(str(n) for n in sorted(counts))
    return f"{counts_text} {'device' if counts == {1} else 'devices'}"


def page(text: str) -> str:
    """`text` (the page) with the table between its markers made again."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{PAGE} lacks the markers {BEGIN!r} and {END!r}")
    return f"{head}{BEGIN}\n\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    PAGE.write_text(page(PAGE.read_text()))
    sys.exit(0)
