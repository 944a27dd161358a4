"""Real test beds the benchmarks and the tests share, with no test tools needed: a single-node
Slurm (slurm.py). The tests wrap them in pytest fixtures (tests/slurm_cluster.py)."""
