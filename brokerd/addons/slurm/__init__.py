"""vaccel on a node Slurm also manages (`[slurm] mode = "delegate"`, docs/slurm.md): the
broker asks Slurm for every allocation instead of making its own (delegate.py), runs
Slurm's programs off the event loop (commands.py), reads what they print (jobs.py),
remembers which job is behind which lease (table.py) and shows Slurm's jobs and queue in
`vaccel status` (status.py)."""
