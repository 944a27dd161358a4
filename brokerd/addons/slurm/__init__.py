"""vaccel on a node Slurm also manages (`[slurm] mode = "delegate"`, docs/slurm.md): the
broker asks Slurm for every allocation instead of making its own (delegate.py), runs
Slurm's programs off the event loop (commands.py), reads `squeue --json` (jobs.py), finds
each request's job by its mark and owner and checks it before a grant (claims.py), keeps
which job is behind which lease and cancels them (ours.py, on disk in table.py) and shows
Slurm's jobs and queue in `vaccel status` (picture.py)."""
