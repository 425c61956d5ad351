"""Prints a digest of the job secret a rank got from its launcher, and whether it shows on the
command line of the rank or of its parent (ddlrun), where ps would show it to anyone."""

import hashlib
import os

secret = os.environ.get("DDL_SECRET", "")
seen = []
for pid in ("self", str(os.getppid())):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        seen.append(bool(secret) and secret.encode() in f.read())
digest = hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else "-"
os.write(
    1,
    f"secret={digest} len={len(secret)} on_cmdline={any(seen)} "
    f"file={os.environ.get('DDL_SECRET_FILE', '-')}\n".encode(),
)
