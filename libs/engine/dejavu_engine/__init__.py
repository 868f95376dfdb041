"""DejaVu stage engine: runs a contiguous layer range of a causal LM with a preallocated KV cache."""
