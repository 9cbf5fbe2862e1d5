#!/usr/bin/env bash
# Build the sidecar's native key map (sidecar/kvoffload_sidecar/_keymap.c) in place for the
# python3 on PATH, where no `pip install` of the project runs (the GPU host's carried tree).
# Without a compiler or Python headers the sidecar serves with its dict fallback; this says so.
set -uo pipefail
src=sidecar/kvoffload_sidecar/_keymap.c
read -r inc suffix < <(python3 -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
out=sidecar/kvoffload_sidecar/_keymap$suffix
if cc -O2 -shared -fPIC -I"$inc" "$src" -o "$out" 2>/tmp/keymap-build.log; then
  echo "native key map built: $out"
else
  echo "native key map not built (the dict serves):"; tail -3 /tmp/keymap-build.log
fi
python3 -c 'import sys; sys.path.insert(0, "sidecar"); sys.path.insert(0, "protos/gen")
from kvoffload_sidecar import keymap; print("sidecar key map:", "native" if keymap.NativeKeyMap else "dict")'
