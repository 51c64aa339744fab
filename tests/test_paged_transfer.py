"""kvarn.paged.transfer: a step's index tensors reach the device aligned, whatever the step's sizes."""

import numpy as np
import torch

G = 8


def test_plan_and_page_index_tensors_start_on_16_byte_boundaries():
    """Triton compiles a variant per pointer alignment: the index tensors of a step, staged in one copy, must
    not start at offsets that follow the step's sizes (odd token, commit and row counts here)."""
    from kvarn.paged import PageLayout, TilePlanner, plan_request_slots, to_device_aligned

    table = torch.tensor([[7, 3, 9, 4], [5, 6, 0, 0], [1, 2, 8, 0]])
    plan = plan_request_slots(torch.tensor([0, 25, 26, 29]), torch.tensor([30, 8, 19]), table, 29, [2, 1, 0], G)
    tensors = {k: v for k, v in vars(plan).items() if isinstance(v, torch.Tensor)}
    planner = TilePlanner(4, G, num_sink_slots=3)
    planner.plan(torch.tensor([0, 3, 8]), torch.tensor([3, 5]), table[:2], 8)
    tile_plan = planner.plan(torch.tensor([0, 19, 23, 40]), torch.tensor([22, 9, 17]), table[:3], 41)
    assert tile_plan.late_tail_slot_mapping is not None and tile_plan.sink_slots is not None
    tensors |= {f"tile plan {k}": v for k, v in vars(tile_plan).items() if isinstance(v, torch.Tensor)}
    layout = PageLayout.of([(0, 0, 25, 30), (2, 26, 29, 19)], G)
    tensors |= {f"page {k}": v for k, v in layout.on("cpu").items()}
    assert len(tensors) > 27
    assert all(t.data_ptr() % 16 == 0 for t in tensors.values()), {k: t.data_ptr() % 16 for k, t in tensors.items()}
    parts = to_device_aligned([np.arange(3), np.arange(0), np.arange(5).reshape(5, 1)], "cpu")
    assert [p.tolist() for p in parts] == [[0, 1, 2], [], [0, 1, 2, 3, 4]]
