"""Constrained decoding: regex, JSON schema and choice constraints compiled with outlines-core
into token-level finite-state machines, applied as a mask on the logits."""
