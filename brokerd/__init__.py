"""vaccel-brokerd: the per-host GPU broker daemon.

Its packages are layers, lowest first; a module imports its own layer and those below it,
never one above (tests/test_project_rules.py checks it, and that no imports go round in a
circle). A request walks down them: edge -> core -> leasing -> state.

    base      logging, a process's kernel identity, facts from /proc, a user's groups,
              trusted folders, a loopback peer's uid
    devices   the device model, the probes (the only vendor code), re-probing, occupancy
    contract  what a job needs, checked against what a device offers
    leasing   the lease manager: holdings, the fair queue, reservations, selection (pure)
    config    the TOML configuration and its [policy] section
    state     the SQLite store, waiting-request records, the state directory, accounting
    core      BrokerService and its parts: acquire, queue, ledger, governance, expiry, inventory
    edge      the gRPC servicer, identity tokens, side calls, the bounds clients meet
    addons    optional parts behind declared interfaces: enforce, slurm, web, metrics, job mapping
    daemon    the command line, assembly, systemd notify, unit install

Data flows one way: probe -> inventory -> contract filter -> policy/selection ->
lease manager -> store -> reply.
"""

__version__ = "0.1.0"
