"""Generated gRPC code for the vaccel.v1 API (scripts/gen_proto.py; do not edit)."""

from vaccel_common.proto_loader import preload as _preload

_preload(__name__, ("broker",))  # the message classes without protobuf's Python layer
