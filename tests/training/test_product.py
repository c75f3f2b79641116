"""Every model at 2 and 4 devices on every mesh (dp, tp, dp x tp, 2 pipeline stages), and every
sharding level on the meshes with replicas: five AdamW steps give the losses single-process
torch training gives (see test_training.py). A covering set, not the full product: each model
meets every mesh and every level, and each (mesh with replicas, level) pair is met by one
model (a Latin square over the models).

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
MODELS = ("llama", "gpt2", "mixtral")
# (devices, pp, dp, tp): meshes without replicas run unsharded, those with them take levels
MESHES = [(2, 1, 1, 2), (2, 2, 1, 1), (4, 1, 4, 1), (4, 1, 1, 4)]
REPLICATED = [(2, 1, 2, 1), (4, 1, 2, 2), (4, 2, 2, 1)]


def _product(name: str) -> list[tuple]:
    i = MODELS.index(name)
    cases = [(name, devices, pp, dp, tp, (), False) for devices, pp, dp, tp in MESHES]
    for j, level in enumerate(LEVELS):
        devices, pp, dp, tp = REPLICATED[(i + j) % len(REPLICATED)]
        cases.append((name, devices, pp, dp, tp, level, False))
    return cases


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


TestLlama, TestGpt2, TestMixtral = (_model_class(name) for name in MODELS)
