"""Running a command under a lease: the runner (start the command, forward signals, stop it
at the lease's end, give the lease back), the quick run of a plain `vaccel run` on the
identity socket (quick_run, with its forked child), the command's process tree, and finding
the command on PATH before anything is asked.

May import: vaccel.containers, vaccel.slurm, vaccel.session, vaccel.contract, vaccel_common.
Keep the package's import free: the quick run's import budget counts every module
(tests/test_quick_run.py).
"""
