"""`python -m vaccel`: the `vaccel` command, fast paths included."""

from vaccel.entry import main

main()
