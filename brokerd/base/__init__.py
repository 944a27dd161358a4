"""The bottom layer: what every part of the daemon uses and that knows nothing of leases.

Owns: the journal (`log_event`, structured lines under systemd), the kernel's identity of
a process (ProcessId, Identity, Holder), and read-only facts about processes from /proc.
May import: nothing of brokerd (vaccel_common only).
"""
