"""A wrapper, as ``conda run`` or a job script in Python is: runs its arguments as a child
process with subprocess's defaults (inherited descriptors closed), and exits with its code."""

import subprocess
import sys

sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)
