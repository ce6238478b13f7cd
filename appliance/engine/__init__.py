"""The worker side: device tensors (weights, KV pool, linear-attention state pool, request table),
forward, sampling, MTP accept/commit and drafting."""
