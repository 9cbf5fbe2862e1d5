"""`python -m kvoffload_sidecar ...` runs the sidecar, like `kvoffload sidecar ...`."""

import sys

from kvoffload_sidecar.cli import main_sidecar

if __name__ == "__main__":
    sys.exit(main_sidecar(sys.argv[1:]))
