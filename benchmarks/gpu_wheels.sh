#!/usr/bin/env bash
# The packages the lent GPU machine's image lacks that the engine and its tests use (xgrammar
# and what it needs, jsonschema for the grammar tests), as CPython 3.12 x86-64 wheels in
# .whl/, at the versions of this checkout's .venv (what CI tests). Run here before the device
# call, then name ".whl" in the call's carry; gpu_session.sh installs them there. About 8 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
      jsonschema jsonschema-specifications referencing rpds-py)
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
pins=$(.venv/bin/python -c 'import sys, importlib.metadata as m
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' "${PKGS[@]}")
rm -rf .whl
# shellcheck disable=SC2086  # one word per pin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
