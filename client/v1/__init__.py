"""Generated gRPC code for vaccel.v1."""
