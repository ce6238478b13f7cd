"""The vision library: image decoding, Qwen-VL preprocessing, the ViT encoder, its memory
reservation, the embedding cache and the shared-memory format of image embeddings.

Imports nothing of `appliance` (the visual server role around it is appliance/encoder/, the
LLM-side splice and M-RoPE are appliance/engine/mm_inputs.py and appliance/models/mrope.py).
Nothing is imported eagerly; the torch-free modules (`image_io`, `preprocess`, `checkpoint`,
`cache`) are what the API server and the launcher import.

Modules and the calls the appliance makes:
- `visual.image_io` (API server): `await load_image(url, ImageLimits, FetchOptions)` for an OpenAI
  `image_url.url` (data: URI or http(s)), or `decode_image(bytes)`; every refusal is `ImageError`
  with a client-facing `reason` (map to HTTP 400).
- `visual.preprocess` (API server and visual server): `PreprocessConfig.from_pretrained(model_dir)`;
  `num_image_tokens(height, width, config)` gives the `<|image_pad|>` count before any pixel work;
  `preprocess_images(images, config) -> (pixel_values [N, 1536] f32, grid_thw [images, 3] int64)`,
  bit-identical to transformers' `Qwen2VLImageProcessorPil`.
- `visual.checkpoint` (launcher, API server, visual server): `has_vision_tower(model_dir)`,
  `image_token_id(model_dir)`, `preprocess_config(model_dir)`, read without torch.
- `visual.encoder` (visual server): `VisionEncoder.from_pretrained(model_dir, device, dtype)`, then
  `encode(pixel_values, grid_thw) -> (embeds [tokens, out_hidden], deepstack list)` and
  `split_per_image(embeds, grid_thw)`; `visual.qwen_vit` holds the modules, `visual.weights` the
  safetensors loader (`VisionCheckpointError` names missing/unexpected keys).
- `visual.reservation` (visual server at startup): `plan_reservation(encoder, max_image_pixels,
  batch_size, reserved_mem_gb) -> Reservation`, the worst-case ViT activation memory.
- `visual.pipeline` (visual server's encoder thread): `encode_jobs(encoder, store, jobs, limits)`
  decodes, preprocesses and encodes a batch of `ImageJob`s into shared memory.
- `visual.cache` (visual server, launcher): `EmbeddingCache`, content key -> segment handle with LRU
  eviction and pins; `segment_name`, `remove_leftover_segments(pid)` after a crash.
- `visual.shm` (visual server writes, workers read): `SharedMemoryImageStore`, one segment per image
  holding [1 + deepstack, tokens, hidden]; `UntrackedSegmentStore`, the writer the cache owns.
"""
