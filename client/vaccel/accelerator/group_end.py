"""The end of a process group the accelerator started: before the interpreter's own end,
on every way out, without waiting on a peer.

Why: a gloo worker thread finishes a collective, then drops the work, and with it its last
reference to tensors Python also sees; that needs the GIL. When the main thread goes on
into interpreter shutdown first, the worker is handed a finalising interpreter, and
CPython ends such a thread with pthread_exit, which C++ turns into std::terminate:
"terminate called without an active exception", exit 134, after correct results
(pytorch/pytorch#190489). Destroying the group does not stop those threads here (DDP
keeps the backend alive), so what makes the exit safe is letting them finish first.

So the group vaccel started is ended from an atexit handler, registered when the group is
made, so that it runs before torch's and logging's own (atexit runs last-in, first-out):

1. the GIL is released until none of torch's threads is runnable (two samples in a row,
   at most a second): every finished collective is dropped while Python still runs;
2. then the group is destroyed. No barrier: a peer that died or exited first must not
   hang this one, and destroying a gloo group sends nothing.

A SIGTERM that Python turns into SystemExit (vaccel.lease() does) takes the same path; a
signal that kills the process outright runs no interpreter shutdown, hence no abort. A
group the script destroyed itself, or replaced, is left alone.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

_TORCH_THREAD_PREFIX = "pt_"  # how torch names its worker threads: pt_gloo_runloop, pt_tcpstore_uv, ...
_PAUSE_S = 0.01
_QUIET_SAMPLES = 2
_MOST_S = 1.0

_registered: list[Any] = []  # the group the handler ends (one per process: the default group)


def end_at_exit(group: Any) -> None:
    """End `group` (the default process group this process just made) at interpreter exit."""
    _registered[:] = [group]
    atexit.unregister(_end_registered)
    atexit.register(_end_registered)


def forget() -> None:
    """The group was ended another way (Accelerator.close())."""
    _registered.clear()
    atexit.unregister(_end_registered)


def let_workers_finish(most_s: float = _MOST_S) -> None:
    """Release the GIL until no torch thread of this process is runnable, so that any of
    them that still has a finished collective to drop gets the GIL to drop it now."""
    deadline = time.monotonic() + most_s
    quiet = 0
    while quiet < _QUIET_SAMPLES and time.monotonic() < deadline:
        time.sleep(_PAUSE_S)
        quiet = 0 if _torch_threads_runnable() else quiet + 1


def _torch_threads_runnable() -> bool:
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no procfs: the pauses alone must do
        return False
    for task in tasks:
        if task == str(me):
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        state = stat[stat.rfind(")") + 2:][:1]
        if name.startswith(_TORCH_THREAD_PREFIX) and state == "R":
            return True
    return False


def _end_registered() -> None:
    group = _registered[0] if _registered else None
    _registered.clear()
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.group.WORLD is not group:
        return  # the script ended it, or made another one: not ours to end
    let_workers_finish()
    dist.destroy_process_group()
