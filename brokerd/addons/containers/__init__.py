"""Containers as lease holders (docs/containers.md): the broker's side of `vaccel run -- docker
run ...` and of a client joining from inside a container.

- locate.py: which container a host process is in, from /proc (cgroup, pid namespace);
- engine.py: Docker's Engine API and podman's compatible one over a Unix socket (inspect,
  stop with a grace, kill), every call bounded by a timeout;
- membership.py: whether a process or a named container is a lease's, confirmed by the
  engine (rootful) or the kernel (rootless), and stopping it.

Self-contained: nothing here imports the lease core; the core calls in (WIRING.md). The
daemon imports this package only when `[containers]` names an engine (it brings aiohttp).
"""
