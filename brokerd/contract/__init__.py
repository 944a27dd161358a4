"""Runtime contracts: what a job needs (gpus, memory, runtime-spec.yaml,
accelerator-config.yaml, the client's own torch build) checked against each device.

The lease manager sees only `Requirement` and `evaluate` here, and picks devices with
brokerd.leasing.selection; the data model is in `model`, parsing of the contract files and the
individual checks in the other modules of this package. A bad contract file raises
`ContractError` (a ValueError naming file, line and key).
"""

from __future__ import annotations

from brokerd.contract.checks import evaluate
from brokerd.contract.located import ContractError
from brokerd.contract.model import CheckLine, ClientFacts, Evaluation, Requirement

__all__ = ["CheckLine", "ClientFacts", "ContractError", "Evaluation", "Requirement", "evaluate"]
