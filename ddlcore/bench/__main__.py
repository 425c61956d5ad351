"""``python -m ddlcore.bench``: `ddlcore.bench.main`, with a failure to join the job (a
`DDLError`, or a bad value: a `ValueError` naming it) said in one line per rank, as ddl-bench's
other errors are; ``DDL_DEBUG=1`` shows the traceback."""

from __future__ import annotations

import sys

from ddlcore import config
from ddlcore.bench import main as _bench_main
from ddlcore.errors import DDLError


def main(argv: list[str] | None = None) -> int:
    """ddl-bench's entry point: `ddlcore.bench.main`, its errors in one line."""
    try:
        return _bench_main(argv)
    except (DDLError, ValueError) as exc:
        if config.debug():
            raise
        raise SystemExit(f"ddl-bench: {' '.join(str(exc).split())}") from None


if __name__ == "__main__":
    sys.exit(main())
