import sys

from kvoffload_sidecar.node.agent import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
