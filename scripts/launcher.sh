#!/usr/bin/env bash
# Replace pip's `vaccel` console script in VENV with one that imports only vaccel.entry.
# pip's imports re (~5 ms on a 2-core machine: half of what `vaccel status` may spend
# beyond the interpreter's start, client/vaccel/entry.py). The entry point is the same
# (pyproject.toml: vaccel = "vaccel.entry:main"), so a plain pip install still works, a
# little slower. Usage: scripts/launcher.sh VENV
set -euo pipefail
VENV=${1:?give the venv path}
script="$VENV/bin/vaccel"
printf '#!%s\n# vaccel (scripts/launcher.sh): pip'"'"'s console script without its import of re.\nfrom vaccel.entry import main\n\nmain()\n' \
    "$VENV/bin/python3" > "$script.new"
chmod 755 "$script.new"
mv -f "$script.new" "$script"
