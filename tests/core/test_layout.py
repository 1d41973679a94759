"""Flat parameter layouts: groups of coordinates by name."""

import pytest
import torch

from smp_core.layout import group_indices


def test_group_indices_take_slices_indices_and_boolean_masks():
    mask = torch.tensor([False, True, False, True, True])
    assert group_indices("m", mask, 5).tolist() == [1, 3, 4]
    assert group_indices("s", slice(2, 4), 5).tolist() == [2, 3]
    assert group_indices("i", [4, 0], 5).tolist() == [4, 0]
    assert group_indices("i", torch.tensor([1, 2], dtype=torch.int32), 5).dtype == torch.long


@pytest.mark.parametrize("group, match", [
    (torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0]), "integer indices, a slice or a boolean mask"),  # not indices 0 and 1
    (torch.tensor([True, False]), "boolean mask must have 5 entries"),
    ([], "got 0 of them"),
    ([1, 5], "from 1 to 5"),
    ([-1], "in \\[0, 5\\)"),
    (torch.zeros(5, dtype=torch.bool), "got 0 of them"),
])
def test_bad_groups_name_the_group_and_the_problem(group, match):
    with pytest.raises(ValueError, match=f"group 'g'.*{match}|{match}"):
        group_indices("g", group, 5)
