"""One rank of tests/integration/test_netns.py's partition test: allreduces until the network
splits, then what the failure and the shrink did, as one line on stdout.

Prints "ready" once the communicator works; the test then cuts a host off. A rank on the larger
side (or the half with rank 0) prints "went on: <size> <member ids> <allreduce ok>"; a rank on
the other side "stopped: <error class>".
"""

import sys

import numpy as np

import ddlcore


def main() -> None:
    comm = ddlcore.init()
    x = np.arange(1000, dtype=np.float32)
    comm.allreduce(x)
    print("ready", flush=True)
    try:
        while True:
            comm.allreduce(x)
    except ddlcore.PeerFailureError as exc:
        print(f"failed: {type(exc).__name__} blaming rank {exc.peer}", flush=True)
    try:
        new = comm.shrink()
    except ddlcore.ExcludedError as exc:
        print(f"stopped: {type(exc).__name__}: {exc}", flush=True)
        return
    y = new.allreduce(x)
    ok = bool(np.array_equal(y, x * new.size))
    print(f"went on: {new.size} {list(new.member_ids)} {ok}", flush=True)
    new.close()


if __name__ == "__main__":
    sys.exit(main())
