"""How a client proves who it is on every call.

The client connects to the identity socket (`paths.identity_socket`), where the daemon
reads the kernel's SO_PEERCRED for the connection and answers one JSON line,
`{"token": ..., "expires": unix_time}` or `{"error": ...}`. The token then travels in
this gRPC metadata key; the daemon's interceptor trusts nothing else.
"""

TOKEN_METADATA_KEY = "vaccel-token"
