"""The daemon's configuration: the TOML file and command-line overrides (loader), and its
`[policy]` section (per-user and per-group limits, time limits, the fair queue's settings).

Owns: parsing and validating every key, so a reload can reject a bad file.
May import: brokerd.base, brokerd.leasing (the limits a request carries).
"""
