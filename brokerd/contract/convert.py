"""Translation between the API messages and the contract types, for the servicer."""

from __future__ import annotations

from brokerd.contract.accel_config import parse_accelerator_config
from brokerd.contract.model import CheckLine, ClientFacts, Requirement
from brokerd.contract.spec import parse_runtime_spec
from vaccel_common.v1 import broker_pb2


def facts_from_proto(msg: broker_pb2.ClientFacts | None) -> ClientFacts:
    """The client's facts as the contract checks read them (empty when not sent)."""
    if msg is None:
        return ClientFacts()
    return ClientFacts(
        python_version=msg.python_version,
        torch_version=msg.torch_version,
        torch_backend=msg.torch_backend,
        torch_runtime_version=msg.torch_runtime_version,
        kernel_archs=tuple(msg.kernel_archs),
        ptx_archs=tuple(msg.ptx_archs),
        distributed_available=msg.distributed_available,
        distributed_backends=tuple(msg.distributed_backends),
        packages=dict(msg.packages),
        python_executable=msg.python_executable[:1024],  # only ever shown back to its sender
    )


def check_line_to_proto(line: CheckLine) -> broker_pb2.CheckLine:
    return broker_pb2.CheckLine(
        level=line.level,
        name=line.name,
        message=line.message,
        device_uuid=line.device_uuid,
        suggestion=line.suggestion,
    )


def requirement_from_request(
    gpus: int,
    min_memory_mib: int,
    spec_yaml: str,
    spec_name: str,
    config_yaml: str,
    config_name: str,
    facts_msg: broker_pb2.ClientFacts | None,
) -> Requirement:
    """Parse both contract files (empty text: not given) into one Requirement.
    Raises ContractError (a ValueError) naming file, line and key: INVALID_ARGUMENT."""
    spec = parse_runtime_spec(spec_yaml, spec_name or "runtime-spec.yaml") if spec_yaml else None
    config = (parse_accelerator_config(config_yaml, config_name or "accelerator-config.yaml")
              if config_yaml else None)
    return Requirement(
        gpus=gpus,
        min_memory_mib=max(min_memory_mib, spec.min_memory_mib if spec else 0),
        spec=spec,
        config=config,
        facts=facts_from_proto(facts_msg),
    )
