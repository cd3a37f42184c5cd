"""[worker] InternVL3 and InternVL3.5 (``internvl_chat``): the default call path; images cut into tiles.

mlx-vlm's processor resizes each image to exactly a grid of square tiles (the grid closest to its
shape) and cuts it, adding a one-tile thumbnail when there are several; so decoding keeps that grid's
size (``InternVLTiles``), not the tile's. ``pixel_values`` is every image's tiles in one array and the
tile counts are not returned per image: no vision cache (the pictures key the image prefix cache).
mlx-vlm's merge places features at the image tokens of one row (``np.where(...)[1]``), so prompts'
images are never embedded together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, TileGrid, limit_of


class InternVLAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("internvl_chat",)

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, _tiles_limit)

    def vision_blocks(self) -> tuple[Any, str] | None:
        return self.model.vision_model.encoder, "layers"  # the merge reads the last block's output alone

    @property
    def mm_prefix_exact(self) -> bool:
        # Plain KV and causal image tokens; an image's <IMG_CONTEXT> run is keyed by its picture (tested
        # against whole prefills)
        return True


@dataclass(slots=True, frozen=True)
class InternVLTiles(TileGrid):
    """mlx-vlm's ``dynamic_preprocess``: an image is resized to exactly the grid of ``min_tiles..max_tiles``
    tiles whose shape is closest to its own (of equal shapes, the one whose area is closest to the image's).
    A shrunk image keeps that grid's size: its shape stays, and an area between the grid's and the
    image's picks the same grid of the equal shapes. (``large`` is unused: every image is tiled.)"""

    def keeps(self, width: int, height: int) -> tuple[float, float]:
        from mlx_vlm.models.internvl_chat.processor import find_closest_aspect_ratio

        # mlx-vlm's candidates in mlx-vlm's order (ties in area keep it)
        ratios = sorted({(i, j) for n in range(self.min_tiles, self.max_tiles + 1) for i in range(1, n + 1)
                         for j in range(1, n + 1) if self.min_tiles <= i * j <= self.max_tiles},
                        key=lambda r: r[0] * r[1])
        # mlx-vlm leaves it unannotated
        columns, rows = find_closest_aspect_ratio(width / height, ratios, width, height, self.tile)  # type: ignore[no-untyped-call]
        return float(columns * self.tile), float(rows * self.tile)


def _tiles_limit(ip: Any) -> ProcessorLimit:
    """The grid of ``size`` tiles (a thumbnail is one tile: within it); without dynamic tiling, one tile.
    Fewer pixels do not mean fewer tiles (the shape picks the grid): no shrinking for ``detail: low``."""
    size, kind = int(ip.size), type(ip).__name__
    if not getattr(ip, "do_dynamic_preprocess", True):
        return ProcessorLimit(kind, fixed=(size, size))
    return ProcessorLimit(kind, tiles=InternVLTiles(size, int(ip.dynamic_min_num), int(ip.dynamic_max_num), 0.0))
