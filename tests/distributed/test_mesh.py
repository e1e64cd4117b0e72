"""Composed meshes train the model one process would: every pairing of the mesh dimensions at size 2 on 4 ranks that
no preset spells (the VGG tiny family; the presets' own files train the others: hsdp, fsdp2_tp, pp x dp, dp x tsp,
fsdp2_tsp), in float64, within 1e-9 relative of none at every step, neurons firing, the validations
and the final state included.

Six steps here, validated at 3 and 6, within the suite's time budget; the guarantee's matrix (``tests/guarantee``,
``-m full_matrix``) runs the same cases for 20 steps on every family, and the three-dimensional layouts on 8 ranks.
"""

import pytest

from snnfw.testing.equivalence import MESH_CASES
from snnfw.testing.guarantee import check_case

STEPS, EVAL_EVERY = 6, 3
PAIRINGS = [case for case in MESH_CASES if case.ranks == 4]


@pytest.mark.parametrize("case", PAIRINGS, ids=[case.name for case in PAIRINGS])
def test_a_pairing_of_mesh_dimensions_matches_none_in_float64(case):
    check_case("cifar10dvs_vgg", case, STEPS, EVAL_EVERY, timeout_s=300)
