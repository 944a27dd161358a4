"""The service around it all: the command line, assembling the parts and running them
(state, inventory, sockets, timers, signals, reload), which add-ons the config turns on,
systemd's notify protocol, and installing the units.

May import: everything in brokerd.
"""
