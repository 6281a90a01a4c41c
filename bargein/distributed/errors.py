"""The errors of ``bargein.distributed``, in one place.

Set-up errors are one line a user can act on (``bargein serve`` prints it and exits 1);
they are raised before anything is left running (what was started is stopped first).
"""

from __future__ import annotations


class PipelineSetupError(Exception):
    """A pipeline or a replica set that cannot be set up as asked; the message says why in one line."""
