"""Zero tensors whose memory the OS hands over on first write (large CPU buffers).

``torch.zeros`` writes every byte, so a KV cache of 512 MiB costs its memset at start-up
(~0.4 s on a busy 2-core machine) and sits in the resident set in full before a token is
stored. Anonymous memory maps are zero by the OS's guarantee and take physical pages only
as they are written: a cache is then resident as far as it is used.
"""

from __future__ import annotations

import mmap

import torch

_MIN_BYTES = 64 << 10  # below this the heap is as good (a small model's per-layer K and V are above it)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU and from 64 KiB up, backed by an anonymous memory map."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: a child made by fork gets its own copy on write, never a view of this cache.
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the map alive
