"""Grammar-constrained decoding: one matcher interface over llguidance or xgrammar, compiled off the loop."""
