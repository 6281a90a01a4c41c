"""The ``bargein`` command's one error class and one set of exit statuses.

Every mistake a user can make (a bad flag value, a missing model, a busy port, a server
that is down, an unknown request id) is a :class:`CliError` carrying its exit status;
``bargein.cli.main`` prints it as one ``bargein: error: ...`` line, never a traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # a failure at run time: a model that does not load, a busy port, a server that is down
EXIT_USAGE = 2  # a bad flag, variable or model reference (a model that is not there)
EXIT_SETUP = 1  # a set-up that cannot run here (no Ray, no cluster, a bad layer split)
EXIT_INTERRUPTED = 130  # Ctrl-C (``bargein run`` after printing what was produced)


class CliError(Exception):
    """A user-fixable problem: printed as one line, exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILURE):
        super().__init__(message)
        self.status = status


class ClientError(CliError):
    """A failure talking to the server, as one line a user can act on (exit 1)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_FAILURE)
