"""Where clients come in: the gRPC servicer, unary calls on the identity socket, the
identity tokens (SO_PEERCRED at connect time), the bounds a client cannot push past, and
the work a client can make expensive (contract parsing) kept off the event loop.

Owns: translating messages to calls into brokerd.core and results back; typed refusals
to status codes. No broker logic and no permission lives here.
May import: brokerd.base, brokerd.devices, brokerd.contract, brokerd.leasing,
brokerd.config, brokerd.state, brokerd.core.
"""
