"""Every model at 2 and 4 devices on every mesh (dp, tp, dp x tp, 2 pipeline stages) with
every sharding level the mesh has a data-parallel axis for (dp 4 alone without sharding): five AdamW steps give the losses
single-process torch training gives (see test_training.py).

One test class per model, so the test processes (pytest-xdist by scope) share them out."""

from __future__ import annotations

import pytest
from tests.training.test_training import case_id, check_steps

LEVELS = [
    (),
    ("optimizer_state_sharding",),
    ("optimizer_state_sharding", "gradient_sharding"),
    ("model_weight_sharding", "model_weight_prefetch"),
]
MESHES = {2: [(1, 2, 1), (1, 1, 2), (2, 1, 1)], 4: [(1, 4, 1), (1, 1, 4), (1, 2, 2), (2, 2, 1)]}


def _product(name: str) -> list[tuple]:
    return [
        (name, devices, pp, dp, tp, sharding, False)
        for devices, meshes in MESHES.items()
        for pp, dp, tp in meshes
        # every level where the mesh has replicas, but dp 4 alone: its levels run on dp 2,
        # dp 2 x tp 2 and 2 stages x dp 2 (the suite's time is bounded)
        for sharding in (LEVELS if dp > 1 and (dp, devices) != (4, 4) else LEVELS[:1])
    ]


def _model_class(name: str) -> type:
    cases = _product(name)

    class Product:
        @pytest.mark.parametrize(
            "name,devices,pp,dp,tp,sharding,tight", cases, ids=[case_id(*c) for c in cases]
        )
        def test_trains_as_torch(
            self, name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path
        ):
            check_steps(name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path)

    Product.__name__ = Product.__qualname__ = f"Test{name.capitalize()}"
    return Product


TestLlama = _model_class("llama")
TestGpt2 = _model_class("gpt2")
TestMixtral = _model_class("mixtral")
