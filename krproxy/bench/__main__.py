"""``python -m krproxy.bench``."""

import sys

from krproxy.bench import main

sys.exit(main())
