"""GroupLayout: packing geometry and the errors bad input gets."""

from __future__ import annotations

import pytest
import torch

from app.grouping import GroupLayout, LayoutError


def left_mask(lengths, width):
    return (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()


def right_mask(lengths, width):
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()


def test_pack_predict_unpack_round_trip():
    prompt_mask, completion_mask = left_mask([3, 2], 4), right_mask([2, 1, 3], 3)
    layout = GroupLayout.from_masks(prompt_mask, completion_mask, [1, 2])
    prompts = torch.tensor([[0, 11, 12, 13], [0, 0, 21, 22]])
    completions = torch.tensor([[101, 102, 0], [201, 0, 0], [301, 302, 303]])
    packed = layout.pack(prompts, completions)
    assert packed.tolist() == [11, 12, 13, 101, 102, 21, 22, 201, 301, 302, 303]
    assert layout.response_starts == (3, 7, 8)
    # the first token of each completion is predicted by its group's last prefix token
    assert layout.predict_index.tolist() == [2, 3, 6, 6, 8, 9]
    assert packed[layout.predict_index].tolist() == [13, 101, 22, 22, 301, 302]
    values = completions.flatten()[layout.target_index].float()
    assert torch.equal(layout.unpack_completion_tokens(values), completions.float() * completion_mask)
    assert layout.repeated_tokens == (3 + 2) + (2 + 1) + (2 + 3)
    assert layout.segment_ids.tolist() == [0, 0, 0, 1, 1, 0, 0, 2, 3, 3, 3]


def test_pack_is_differentiable():
    layout = GroupLayout.from_masks(left_mask([2], 3), right_mask([2, 1], 2), 2)
    prompts = torch.randn(1, 3, 4, requires_grad=True)
    completions = torch.randn(2, 2, 4, requires_grad=True)
    layout.pack(prompts, completions).sum().backward()
    assert prompts.grad[0, :, 0].tolist() == [0.0, 1.0, 1.0]
    assert completions.grad[:, :, 0].tolist() == [[1.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize(
    ("prompt_mask", "completion_mask", "group_sizes", "message"),
    [
        (left_mask([2, 2], 3), right_mask([1, 1, 1], 2), [1, 1], "add up to 2 but there are 3 completions"),
        (left_mask([2, 2], 3), right_mask([1, 1], 2), [1], "has 1 entries but there are 2 prompts"),
        (left_mask([2, 2], 3), right_mask([1, 1], 2), [2, 0], "at least one completion"),
        (left_mask([2], 3), right_mask([1, 0], 2), 2, "completion 1 has length 0"),
        (torch.tensor([[1, 1, 0]]), right_mask([1], 2), 1, "prompt 0 is not left-padded"),
        (left_mask([2], 3), torch.tensor([[0, 1]]), 1, "completion 0 is not a block of ones"),
        (left_mask([0], 3), right_mask([1], 2), 1, "prompt 0 has no tokens"),
        (left_mask([2], 3)[0], right_mask([1], 2), 1, "prompt mask must be 2-D"),
    ],
)
def test_bad_layouts_get_named_errors(prompt_mask, completion_mask, group_sizes, message):
    with pytest.raises(LayoutError, match=message):
        GroupLayout.from_masks(prompt_mask, completion_mask, group_sizes)


def test_pack_checks_shapes():
    layout = GroupLayout.from_masks(left_mask([2], 3), right_mask([1], 2), 1)
    with pytest.raises(LayoutError, match="prompt tensor has shape"):
        layout.pack(torch.zeros(1, 4), torch.zeros(1, 2))
