"""The generated message classes, built straight from protobuf's upb extension.

Why: a generated `_pb2` module imports protobuf's whole Python layer (descriptor_pool,
python_message, text_format, builder, ...) before it builds one class. On a 2-core
machine that is ~25 ms of every `vaccel run -- true`, a fifth of it. With the upb
implementation, protobuf's default since 4.21, none of that layer is needed to build the
classes: the extension's default pool takes the serialized .proto file and its
MessageMeta makes the classes. Those are the calls the generated module ends up making.

How: `vaccel_common.v1` calls `preload()` as it is imported. It puts a module built here
in sys.modules under the generated module's name, so every importer (daemon, client,
tests, the _grpc module) gets one and the same set of classes. The module has what code
uses of the generated one: DESCRIPTOR, each message class (nested classes as its
attributes, with the generated module's __module__ and __qualname__, so pickle finds
them), and each top-level enum with its values. It does not register the classes in
protobuf's deprecated symbol database.

With another implementation (python, cpp), or if anything is not as expected, nothing is
preloaded and the generated module is imported as usual. tests/test_proto_loader.py
checks that both give the same API.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any


def preload(package: str, names: tuple[str, ...]) -> None:
    """For each `name`, `package.name_pb2` built from `package.name_descriptor`."""
    if os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "upb") != "upb":
        return
    try:
        from google._upb import _message as upb
        from google.protobuf import message as message_base
        from google.protobuf.internal import enum_type_wrapper
    except ImportError:
        return  # not the upb implementation: the generated module does the work
    for name in names:
        module_name = f"{package}.{name}_pb2"
        if module_name in sys.modules:
            continue
        serialized = __import__(f"{package}.{name}_descriptor", fromlist=["SERIALIZED"]).SERIALIZED
        module = types.ModuleType(module_name, "Generated protocol buffer code (vaccel_common/proto_loader.py).")
        file = upb.default_pool.AddSerializedFile(serialized)
        module.DESCRIPTOR = file
        for enum_name, enum in file.enum_types_by_name.items():
            setattr(module, enum_name, enum_type_wrapper.EnumTypeWrapper(enum))
            for value in enum.values:
                setattr(module, value.name, value.number)
        for message_name, message in file.message_types_by_name.items():
            setattr(module, message_name, _message_class(upb.MessageMeta, message_base.Message, message,
                                                         module_name, ""))
        sys.modules[module_name] = module
        setattr(sys.modules[package], f"{name}_pb2", module)


def _message_class(meta: Any, base: type, descriptor: Any, module_name: str, prefix: str) -> type:
    namespace = {nested_name: _message_class(meta, base, nested, module_name, f"{prefix}{descriptor.name}.")
                 for nested_name, nested in descriptor.nested_types_by_name.items()}
    namespace.update(DESCRIPTOR=descriptor, __module__=module_name, __qualname__=prefix + descriptor.name)
    return meta(descriptor.name, (base,), namespace)
