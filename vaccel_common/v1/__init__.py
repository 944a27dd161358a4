"""Generated gRPC code for the vaccel.v1 API (scripts/gen_proto.py; do not edit)."""
