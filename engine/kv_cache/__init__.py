"""KV cache groups: which layers share a block table, and the window arithmetic of their blocks
(plain Python, no torch; docs/design/kv-cache-groups.md)."""
