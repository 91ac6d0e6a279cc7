#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (jax >= 0.11 needs it), or fail with a hint.
# Order: $PYTHON, python3.13/python3.12/python3 on PATH, then pyenv's installed versions.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for c in ${PYTHON:-} python3.14 python3.13 python3.12 python3; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then echo "$p"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
    if ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12, or install one, e.g. 'pyenv install 3.12')" >&2
exit 1
