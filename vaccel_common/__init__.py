"""What the daemon and the client share, and nothing else: the generated API (`v1`),
the socket rule (`paths`), the token's metadata key (`auth`), the spelling of sizes and
durations (`units`) and the backend table (`backends`).

Importing any of it has no side effects: no environment is changed, no torch and no
device runtime is loaded. The daemon (`brokerd`) imports this and never `vaccel`.
"""
