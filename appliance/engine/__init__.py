"""The worker side: device tensors (weights, KV pool, linear-attention state pool), forward,
sampling."""
