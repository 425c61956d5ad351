"""Prints the rendezvous variables a rank was started with."""
import os

keys = ["DDL_RANK", "DDL_SIZE", "DDL_LOCAL_RANK", "DDL_LOCAL_SIZE", "DDL_MASTER_ADDR",
        "DDL_MASTER_PORT", "DDL_TRANSPORT", "DDL_TIMEOUT", "PMI_RANK"]
print(" ".join(f"{k}={os.environ.get(k, '-')}" for k in keys))
