"""The ``bargein`` command (console script ``bargein = bargein.cli:main``).

One module per command group: ``serve``, ``chat`` (its REPL in ``repl``, the backends that
answer it in ``backends``), ``run``, ``requests`` (``ps`` and ``cancel``), ``bench`` and
``cluster``; what they share in ``common`` (flags, URLs), ``generate`` (chat's and run's
flags and backend), ``model`` (the one model loader), ``errors`` (the one error class and
the exit statuses), ``client`` (the HTTP client), ``interrupt`` (Ctrl-C) and ``progress``.
"""

from __future__ import annotations

from bargein.cli.entry import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
