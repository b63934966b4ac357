"""The node runtime every role shares: run_node, SGLang's scheduler API (smg-grpc-proto), health, metrics."""
