"""The router-facing gRPC service every node serves: SGLang's scheduler API (smg-grpc-proto)."""
