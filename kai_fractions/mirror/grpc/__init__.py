"""The mirror's gRPC face: the server (grpc.aio, health, reflection), the servicer that maps
kai_fractions.v1.AllocationMirror onto `MirrorService` and its errors onto gRPC status
(`status`), protobuf <-> the mirror's values (`proto`), and TLS / mutual TLS / the bearer
token (`security`)."""
