"""The `vaccel` command line: the parser, the full CLI (full.py: status, run, check, release
and the rest), one module per further command (leases, report and its stream report_pages,
reserve, shell; the table in commands.py), and what the commands share (common.py). `python -m vaccel.cli` runs the
full CLI; the `vaccel` command itself starts at vaccel/entry.py, which answers the fast paths.

May import: everything below it (vaccel.run, containers, slurm, session, contract), the
package root for its version, and vaccel_common. Never vaccel.kernel or vaccel.entry (the
kernel command is registered by name, commands.py).
"""
