"""``python -m ddlcore.launcher``."""

import sys

from ddlcore.launcher import main

sys.exit(main())
