"""`python -m vaccel.cli`: the full CLI, with no fast path (vaccel/entry.py has those)."""

from vaccel.cli.full import main

main()
