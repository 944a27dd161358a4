"""Slurm: a lease from inside a Slurm job (the job's allocation is the lease; the broker
knows the job), and delegate mode's submission (`vaccel run` as an salloc the broker sees).

May import: vaccel.session, vaccel.contract, vaccel_common.
"""
