"""One rank of a test job started by ``mpiexec`` (see ``harness.run_ranks(launcher="mpiexec")``).

Reads the job (function, arguments, environment) the harness wrote, becomes rank PMI_RANK, runs
the function and writes its result or traceback for the harness to collect.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def main(jobdir: str) -> None:
    with open(os.path.join(jobdir, "job.pkl"), "rb") as f:
        fn, args, env, rank_envs = pickle.load(f)
    rank = int(os.environ["PMI_RANK"])
    size = int(os.environ["PMI_SIZE"])
    merged = {**env, **rank_envs.get(rank, {}), "DDL_RANK": str(rank), "DDL_LOCAL_RANK": str(rank)}
    for key, value in merged.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        outcome = ("ok", fn(rank, size, *args))
    except BaseException:  # noqa: BLE001 - forwarded to the harness verbatim
        outcome = ("error", traceback.format_exc())
    with open(os.path.join(jobdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1])
