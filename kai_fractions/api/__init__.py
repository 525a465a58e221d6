"""Generated protobuf and gRPC code for the kai_fractions API (see protos/)."""
