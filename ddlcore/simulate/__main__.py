"""``python -m ddlcore.simulate``: the simulator's command line (`ddlcore.simulate.cli`)."""

import sys

from ddlcore.simulate.cli import main

sys.exit(main())
