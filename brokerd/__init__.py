"""vaccel-brokerd: the per-host GPU broker daemon.

Data flows one way: probe -> inventory -> contract filter -> policy/selection ->
lease manager -> store -> reply. Only brokerd.devices.probes knows about vendors.
"""

__version__ = "0.1.0"
