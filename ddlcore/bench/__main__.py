"""``python -m ddlcore.bench``."""

import sys

from ddlcore.bench import main

sys.exit(main())
