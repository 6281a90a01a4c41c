"""One step's logits written into memory reused from step to step.

A step's logits are (rows, vocab) float32: 32 decoding streams of a 262,144-token vocabulary
(Gemma 3) are 32 MiB. A fresh tensor of that size is a fresh mapping from the allocator
(glibc maps every allocation of 32 MiB or more), whose pages the head's matmul then faults
in and the kernel zeroes, on every step: about a tenth of a 32-stream Gemma 3 step on the
benchmark machine, for nothing. :class:`LogitsBuffer` keeps one allocation, grown to the
largest step seen, up to a byte budget, so steady decoding writes into pages that are
already there.

Contract: a view handed out by :meth:`LogitsBuffer.rows` is valid until the next call of
:meth:`rows` on the same buffer; its owner (the in-process runner) hands the view to the
engine, which samples from it before it collects the next step.
"""

from __future__ import annotations

import torch

# Enough for 64 rows of a 262,144-token vocabulary (341 of a 49,152-token one). A step with
# more rows (a long verification, a large batch) gets a fresh tensor: the buffer stays at
# most this big for the process's life, where a fresh tensor is freed after its step.
DEFAULT_BUDGET_BYTES = 64 << 20


class LogitsBuffer:
    """Float32 (rows, vocab) views into one reused CPU allocation (see the module's contract)."""

    def __init__(self, vocab_size: int, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_rows = max(1, budget_bytes // (4 * vocab_size))
        self._storage = torch.empty(0, dtype=torch.float32)

    @property
    def capacity_rows(self) -> int:
        """Rows the current allocation holds (0 until the first step)."""
        return self._storage.numel() // self.vocab_size

    def rows(self, num_rows: int) -> torch.Tensor | None:
        """A (num_rows, vocab) float32 view of the reused allocation, grown if needed; None
        where ``num_rows`` exceeds the budget's ``max_rows`` (the caller allocates)."""
        if num_rows > self.max_rows:
            return None
        if num_rows > self.capacity_rows:
            # Grow to what is asked, not to the budget: one stream never holds 64 MiB.
            self._storage = torch.empty(num_rows * self.vocab_size, dtype=torch.float32)
        return self._storage[:num_rows * self.vocab_size].view(num_rows, self.vocab_size)
