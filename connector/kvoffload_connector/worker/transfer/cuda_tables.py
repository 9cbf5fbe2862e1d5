"""What the CUDA engine's copy kernels read of a layout: per group, its regions as a device
table (`GroupTable`); per layer-by-layer load, the stages in forward order (`LayerStage`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvoffload_connector.worker.transfer.kernels import unit_bytes, vector_width

if TYPE_CHECKING:
    from kvoffload_connector.worker.layout import CanonicalLayout

STAGING_ALIGN = 256  # staging buffers and copy widths align to this many bytes


@dataclass(frozen=True)
class LayerStage:
    """One layer of a layer-by-layer load: the regions of its group that hold its bytes."""

    group: int
    regions: Any  # torch int64 [r, 4] on the device (rows of the group table)
    n_regions: int
    units_per_region: int
    width: int


@dataclass(frozen=True)
class GroupTable:
    regions: Any  # torch int64 [R, 4] on the device: addr, stride, bytes, offset in block
    n_regions: int
    block_bytes: int
    width: int  # vector width of the copy kernel
    units_per_region: int


def group_table(torch: Any, device: Any, layout: CanonicalLayout, g: Any) -> GroupTable:
    """Group `g`'s regions as the copy kernels read them, on `device`."""
    rows = []
    for r, inoff in zip(g.regions, g.region_offsets(), strict=True):
        base = layout.storages[r.storage].data_ptr()
        rows.append((base + r.offset, r.block_stride, r.block_bytes, inoff))
    arr = np.array(rows, dtype=np.int64)
    width = vector_width([*arr.reshape(-1).tolist(), g.block_bytes, STAGING_ALIGN])
    units = -(-int(arr[:, 2].max()) // unit_bytes(width))
    regions = torch.from_numpy(arr).to(device)
    return GroupTable(regions, len(rows), g.block_bytes, width, units)


def layer_stages(
    layout: CanonicalLayout, tables: dict[int, GroupTable]
) -> tuple[list[LayerStage], dict[str, int]]:
    """Stages of a layer-by-layer load, in forward order, and the stage each layer waits
    for. A layer whose regions an earlier stage already moved (block-major layouts keep
    every layer of a block in one region) waits for that stage."""
    stages: list[LayerStage] = []
    stage_of: dict[str, int] = {}
    done: dict[tuple[int, int], int] = {}  # (group, region) -> stage that moves it
    for name, gid, regions in layout.layers:
        todo = [r for r in regions if (gid, r) not in done]
        if not todo:
            if regions:
                stage_of[name] = max(done[(gid, r)] for r in regions)
            continue
        t = tables[gid]
        rows = t.regions[todo]
        units = -(-int(rows[:, 2].max()) // unit_bytes(t.width))
        stages.append(LayerStage(gid, rows.contiguous(), len(todo), units, t.width))
        for r in todo:
            done[(gid, r)] = len(stages) - 1
        stage_of[name] = max(done[(gid, r)] for r in regions)
    return stages, stage_of
