"""Prefill node: gRPC servicer, prefill batch policy and sending KV handoffs to decode nodes."""
