#!/usr/bin/env bash
# Replace pip's `vaccel` console script in VENV with one that imports only vaccel.entry.
# pip's imports re (~5 ms on a 2-core machine: half of what `vaccel status` may spend
# beyond the interpreter's start, client/vaccel/entry.py). The entry point is the same
# (pyproject.toml: vaccel = "vaccel.entry:main"), so a plain pip install still works, a
# little slower. Usage: scripts/launcher.sh VENV
#
# The kernel splits a `#!` line at its first blank and reads at most 255 bytes of it, so a
# venv whose path has a blank or is long gets pip's own way round it (issue 43): /bin/sh
# starts the interpreter, and the same file is Python to it (the `'''exec'` line is a
# string there).
set -euo pipefail
VENV=${1:?give the venv path}
script="$VENV/bin/vaccel"
python="$VENV/bin/python3"
body='# vaccel (scripts/launcher.sh): pip'"'"'s console script without its import of re.\nfrom vaccel.entry import main\n\nmain()\n'
if [[ $python =~ [[:space:]] || ${#python} -gt 120 ]]; then
    quoted=${python//\\/\\\\}
    quoted=${quoted//\"/\\\"}
    quoted=${quoted//\$/\\\$}
    quoted=${quoted//\`/\\\`}
    { printf '#!/bin/sh\n'
      printf "'''exec' \"%s\" \"\$0\" \"\$@\"\n' '''\n" "$quoted"
      printf "$body"; } > "$script.new"
else
    printf '#!%s\n'"$body" "$python" > "$script.new"
fi
chmod 755 "$script.new"
mv -f "$script.new" "$script"
