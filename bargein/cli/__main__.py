"""``python -m bargein.cli``: the same as the ``bargein`` console script."""

import sys

from bargein.cli.entry import main

sys.exit(main())
