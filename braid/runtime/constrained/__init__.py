"""Constrained decoding: regex, JSON schema and choice constraints compiled with outlines-core
into token-level automata.

- `grammar`: compiled grammars (bounded LRU cache, forced strings); a matcher per request.
- `spec`: spec -> regex -> outlines-core index (no torch: the compile worker imports it).
- `compile_pool`: compiling in worker processes (`compile_worker`), off the scheduler's critical
  path, time-limited; an overrunning compile's worker is killed and replaced.
- `bitmask`: each step's allowed tokens as int32 bitmask rows, applied to the logits.
- `jump_forward`: text a grammar forces, appended without sampling it token by token.
- `vocab`: the tokenizer's vocabulary as bytes.
"""
