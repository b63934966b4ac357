"""Decode node: gRPC servicer, decode batch policy (prealloc, transfer, running) and receiving KV."""
