"""STANDALONE speculative decoding for pdserve: a small draft LM proposes chains the target verifies."""

from pdserve_standalone.algorithm import StandaloneAlgo

__all__ = ["StandaloneAlgo"]
