"""``python -m krproxy`` is the ``krproxy`` command."""

import sys

from krproxy.cli import main

sys.exit(main())
