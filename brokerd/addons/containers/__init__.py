"""Containers as lease holders (docs/containers.md): the broker's side of `vaccel run -- docker
run ...` and of a client joining from inside a container.

- locate.py: which container a host process is in, from /proc (cgroup, pid namespace);
- info.py, engine.py: Docker's Engine API and podman's compatible one over a Unix socket
  (inspect, list by label, stop with a grace, kill), every call bounded by a timeout;
- membership.py: whether a process or a named container is a lease's, confirmed by the
  engine (rootful) or the kernel (rootless), and stopping it;
- keeper.py: the ContainerKeeper the core asks (brokerd/core/plugins.py) and the lease hook
  that stops a lease's containers at its end; warning.py: the warning before that end.

The core records and watches what the keeper confirms (brokerd/core/container_holds.py) and
imports nothing of this package; brokerd/daemon/addons.py plugs it in. aiohttp is imported
only when `[containers]` names an engine.
"""
