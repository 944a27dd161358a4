"""What a client asks the broker for (LeaseRequest), checked when made, and how it becomes
the wire request: the wait, the time limit, the contract files, and the client's facts
(gathered, with torch's import, only when they are sent).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

from vaccel.contract.files import ContractFiles, load_contract_files
from vaccel_common.units import parse_duration, parse_time_limit
from vaccel_common.v1 import broker_pb2 as pb


def wait_fields(wait: bool | float | str | None) -> tuple[bool, float]:
    """(wait_forever, max_wait_seconds) of the request: True waits in the queue for as long
    as it takes, False or None fails at once when busy, a number or "2h" gives up after that."""
    if wait is True:
        return True, 0.0
    if wait is False or wait is None:
        return False, 0.0
    return False, parse_duration(wait)


# Past this a time limit is a typo (the broker's policy refuses far less, with its ceiling).
_LONGEST_S = 366 * 86400.0


def time_limit_s(value: float | str | None) -> float:
    """Seconds of a time limit ("2h", "90m", 3600, Slurm's "01:30:00"); None = 0, the broker's default."""
    if value is None:
        return 0.0
    try:
        seconds = parse_time_limit(value)
    except ValueError as exc:
        raise ValueError(f"time limit: {exc}") from None
    if not seconds > 0:
        raise ValueError(f"a time limit must be longer than 0, got {value!r}")
    if seconds > _LONGEST_S:
        raise ValueError(f"a time limit of {value!r} is absurd: at most 366 days (the broker's policy "
                         "may allow far less; `vaccel status` shows it)")
    return seconds


class _RequestFields(NamedTuple):
    gpus: int = 1
    min_memory_mib: int = 0
    wait: bool | float | str | None = True
    contract: str | os.PathLike[str] | None = None
    config: str | os.PathLike[str] | None = None
    command: str = ""
    in_process: bool = False
    time: float | str | None = None  # the lease's time limit ("2h"); None = the broker's default
    devices: tuple[str, ...] = ()  # only these devices ("gpu1", an index or a uuid)
    reservation: bool = False  # held by the user, not this process (`vaccel reserve`)
    memory_mib: int = 0  # > 0: a memory share of one shared device, not whole devices (docs/sharing.md)
    import_torch: bool = True  # False: without a contract, no torch facts rather than wait for torch's import
    argv: tuple[str, ...] = ()  # the command run on the lease (vaccel run): its interpreter's facts are sent


class LeaseRequest(_RequestFields):
    """What to ask the broker for; `build` turns it into the wire request. Checked when
    made: a bad count or duration is the caller's mistake, said now, not when queueing.

    `in_process` says the job runs in this very interpreter (lease()) rather than in a
    command started afterwards (`vaccel run`); it decides whether client facts are sent.
    (A NamedTuple, not a dataclass: importing dataclasses costs every `vaccel run` ~11 ms.)
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> LeaseRequest:
        self = super().__new__(cls, *args, **kwargs)
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        wait_fields(self.wait)
        time_limit_s(self.time)
        if self.memory_mib < 0:
            raise ValueError(f"memory must not be negative, got {self.memory_mib} MiB")
        if self.memory_mib and self.gpus != 1:
            raise ValueError(f"a memory share is of one GPU: ask for memory without gpus={self.gpus} "
                             "(or for whole devices without memory)")
        return self

    def build(self, cwd: str) -> tuple[pb.AcquireRequest, ContractFiles]:
        """The Acquire request and the contract files it carries (ContractFileError when a
        named file cannot be read)."""
        files = load_contract_files(self.contract, self.config, cwd)
        wait_forever, max_wait_s = wait_fields(self.wait)
        request = pb.AcquireRequest(
            gpus=self.gpus, min_memory_mib=self.min_memory_mib,
            wait_forever=wait_forever, max_wait_seconds=max_wait_s,
            runtime_spec_yaml=files.spec_text, runtime_spec_name=files.spec_name,
            accelerator_config_yaml=files.config_text, accelerator_config_name=files.config_name,
            command=self.command[:200], time_limit_s=time_limit_s(self.time),
            devices=list(self.devices), reservation=self.reservation, memory_mib=self.memory_mib,
        )
        if self.sends_facts(files) and self.argv and not self.in_process:
            from vaccel.contract.job_python import facts_for_run  # the job's Python, not this one

            facts, line = facts_for_run(self.argv, files.packages)
            request.client.CopyFrom(facts)
            files = files._replace(checked_against=line)
        elif self.sends_facts(files):
            from vaccel.contract.facts import gather_facts  # imports torch: only when the facts are sent

            request.client.CopyFrom(gather_facts(files.packages, inspect_torch=self.inspects_torch(files)))
        return request, files

    def inspects_torch(self, files: ContractFiles) -> bool:
        """Whether the facts include torch's build. A contract is checked against them, so
        then always; without one they only make advisory warnings, and a caller that must
        not wait ~1-2 s for torch's import before its lease (the notebook kernel) goes
        without them, unless torch is imported already (then they cost nothing)."""
        return self.import_torch or not files.empty or "torch" in sys.modules

    def sends_facts(self, files: ContractFiles) -> bool:
        """Facts describe this interpreter (its torch build, its packages). The daemon checks
        them against a contract, and without one only turns a torch mismatch into an advisory
        warning. So they go with a contract, or when this interpreter is the job itself;
        a command started later may be another program, and gathering them imports torch."""
        return not files.empty or self.in_process
