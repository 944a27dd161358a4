"""vaccel_common/proto_loader.py: the message classes built straight from upb are the
generated module's API, one set per process, and cost less to import.

Each side is described in its own interpreter: the preloaded module (protobuf's default
upb implementation) and the generated one (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python,
which the loader leaves alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

DESCRIBE = r"""
import json, pickle, sys
from vaccel_common.v1 import broker_pb2 as pb

def classes(owner, prefix=""):
    for name in sorted(vars(owner)):
        value = getattr(owner, name)
        if isinstance(value, type) and hasattr(value, "DESCRIPTOR") and value.DESCRIPTOR.full_name.endswith(name):
            yield prefix + name, value
            yield from classes(value, prefix + name + ".")

lease = pb.Lease(id="l-1", backend="cuda", holder=pb.Holder(user="alice", uid=1000, pid=42))
lease.devices.add(index=3, uuid="GPU-3", memory_mib=81920)
facts = pb.ClientFacts()
facts.packages["torch"] = "2.13.0"
out = {
    "preloaded": not hasattr(pb, "__file__"),
    "classes": {name: [cls.__module__, cls.__qualname__, sorted(f.name for f in cls.DESCRIPTOR.fields)]
                for name, cls in classes(pb)},
    "file": pb.DESCRIPTOR.name,
    "services": sorted(pb.DESCRIPTOR.services_by_name["Broker"].methods_by_name),
    "wire": [lease.SerializeToString().hex(), facts.SerializeToString().hex()],
    "pickled": pickle.loads(pickle.dumps(lease)) == lease,
    "python_layer": sorted(m for m in ("google.protobuf.text_format", "google.protobuf.internal.python_message",
                                       "google.protobuf.descriptor_pool") if m in sys.modules),
}
from vaccel_common.v1 import broker_pb2_grpc  # the stubs take the same classes
from google.protobuf import descriptor_pool, json_format
out["one_set"] = broker_pb2_grpc.vaccel_dot_v1_dot_broker__pb2 is pb and (
    descriptor_pool.Default().FindMessageTypeByName("vaccel.v1.Lease") is pb.Lease.DESCRIPTOR)
out["json"] = json_format.MessageToDict(lease)
print(json.dumps(out))
"""


def describe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DESCRIBE], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_preloaded_classes_are_the_generated_modules_api() -> None:
    fast = describe()
    generated = describe(PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    assert fast["preloaded"] and not generated["preloaded"]
    assert fast["python_layer"] == []  # what it saves: none of protobuf's Python layer
    assert "ClientFacts.PackagesEntry" in fast["classes"] and "Lease" in fast["classes"]
    for key in ("classes", "file", "services", "wire", "json"):
        assert fast[key] == generated[key], key
    assert fast["pickled"] and generated["pickled"]
    assert fast["one_set"] and generated["one_set"]

