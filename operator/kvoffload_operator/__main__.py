"""``python -m kvoffload_operator [args]``: the operator (``kvoffload operator``)."""

import sys

from kvoffload_operator.cli import main_operator

sys.exit(main_operator(sys.argv[1:]))
