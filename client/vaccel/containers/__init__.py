"""Containers under a lease: reading an engine's command line (docker, podman: what the user
asked the engine to do, engine_command), the options a leased container may not carry
(rules, options), giving the lease's devices and variables to the container (argv), the
lease held while a detached container runs (hold), and a lease from inside a container (job).

May import: vaccel.slurm, vaccel.session, vaccel.contract, vaccel_common.
"""
