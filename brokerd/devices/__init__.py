"""The host's devices as the daemon sees them, and the only place that knows vendors.

Owns: the vendor-neutral device model (Device, Snapshot), the probes (one per vendor, the
CPU and the simulated inventory) and the vendor facts table, the probe report of `--probe`, re-probing and
distrust of a probe that suddenly finds nothing, which GPU processes occupy which device,
and the device nodes that gate a device.
May import: brokerd.base.
"""
