"""Constrained decoding: regex, JSON schema and choice constraints compiled with outlines-core
into token-level automata.

- `grammar`: spec -> regex -> compiled index (bounded LRU cache); a matcher per request.
- `compile_pool`: compiling on worker threads, off the scheduler's critical path, time-limited.
- `bitmask`: each step's allowed tokens as int32 bitmask rows, applied to the logits.
- `jump_forward`: text a grammar forces, appended without sampling it token by token.
- `vocab`: the tokenizer's vocabulary as bytes.
"""
