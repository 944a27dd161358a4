"""Optional parts, each off unless its config section turns it on, each plugged into the
core through a declared interface (a LeaseHook, an allocator, a change listener):
device-node enforcement (enforce/), Slurm as the allocator (slurm/), the dashboard (web/),
the Prometheus endpoint (metrics) and dcgm-exporter's job mapping (job_mapping).

May import: every layer below brokerd.daemon (the dashboard shows the edge's Status reply).
"""
