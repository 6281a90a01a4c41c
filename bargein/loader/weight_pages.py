"""The pages under the weights' blocks in their files' mappings, as whole-page address
ranges: what bargein.loader.private_weights makes private or gathers, and the kept
weights' pages left out of them.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

from bargein.kernels.quant_weight import QuantWeight

MERGE_GAP = 1 << 20  # two ranges this close, with nothing kept between, are moved as one
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class PageRange:
    """Whole pages ``start`` .. ``end`` (addresses) of one file mapping."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def private_ranges(weights: dict[str, object], keep: Callable[[str], bool],
                   maps: list[tuple[int, int, int, str, int]]) -> tuple[list[PageRange], int]:
    """The pages to make private: those under the blocks of every :class:`QuantWeight` of
    ``weights`` that lie in one of ``maps`` (shared_file_maps), but those whose name ``keep``
    says to leave (a page holding any of their bytes stays mapped); ranges of one mapping
    less than MERGE_GAP apart with no kept block between are joined. Returns the ranges, in
    address order, and the bytes of the kept weights' blocks. Blocks outside every mapping
    are private memory already."""
    wanted: dict[int, list[tuple[int, int]]] = {}  # mapping index: [(lo, hi)] of the blocks
    kept: dict[int, list[tuple[int, int]]] = {}
    kept_bytes, seen_kept = 0, set()
    for name, w in weights.items():
        if not isinstance(w, QuantWeight):
            continue
        for segment in w.segments:
            lo, hi = segment.data.data_ptr(), segment.data.data_ptr() + segment.data.nbytes
            index = next((i for i, (start, end, *_) in enumerate(maps) if start <= lo and hi <= end), None)
            if keep(name):
                if (lo, hi) not in seen_kept:
                    seen_kept.add((lo, hi))
                    kept_bytes += hi - lo
                if index is not None:
                    kept.setdefault(index, []).append((lo, hi))
            elif index is not None:
                wanted.setdefault(index, []).append((lo // _PAGE * _PAGE, -(-hi // _PAGE) * _PAGE))
    ranges: list[PageRange] = []
    for index, spans in sorted(wanted.items(), key=lambda item: maps[item[0]][0]):
        held = kept.get(index, [])
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo - merged[-1][1] <= MERGE_GAP and not any(
                    k_lo < lo and k_hi > merged[-1][1] for k_lo, k_hi in held):
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            for k_lo, k_hi in sorted(held):  # the kept blocks' pages cut out
                k_lo, k_hi = k_lo // _PAGE * _PAGE, -(-k_hi // _PAGE) * _PAGE
                if k_lo < hi and lo < k_hi:
                    if lo < k_lo:
                        ranges.append(PageRange(lo, k_lo))
                    lo = max(lo, k_hi)
            if lo < hi:
                ranges.append(PageRange(lo, hi))
    return ranges, kept_bytes
