"""``python -m ddlcore.trace``."""

import sys

from ddlcore.trace import main

sys.exit(main())
