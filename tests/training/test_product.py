"""Every model at 2 and 4 devices on every mesh (dp, tp, dp x tp, 2 pipeline stages) with
every sharding level the mesh has a data-parallel axis for: five AdamW steps give the losses
single-process torch training gives (see test_training.py)."""

from __future__ import annotations

import pytest
from tests.training.test_training import MODELS, case_id, check_steps

LEVELS = [
    (),
    ("optimizer_state_sharding",),
    ("optimizer_state_sharding", "gradient_sharding"),
    ("model_weight_sharding", "model_weight_prefetch"),
]
MESHES = {2: [(1, 2, 1), (1, 1, 2), (2, 1, 1)], 4: [(1, 4, 1), (1, 1, 4), (1, 2, 2), (2, 2, 1)]}
PRODUCT = [
    (name, devices, pp, dp, tp, sharding, False)
    for name in MODELS
    for devices, meshes in MESHES.items()
    for pp, dp, tp in meshes
    for sharding in (LEVELS if dp > 1 else LEVELS[:1])
]


@pytest.mark.parametrize(
    "name,devices,pp,dp,tp,sharding,tight", PRODUCT, ids=[case_id(*c) for c in PRODUCT]
)
def test_every_model_mesh_and_level_trains_as_torch(
    name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path
):
    check_steps(name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path)
