"""The vision side of the appliance: image decoding, Qwen-VL preprocessing and the ViT encoder.

Imported by the API server (torch-free modules only: `image_io`, `preprocess`) and by the visual
server process (`encoder`). Nothing is imported eagerly: `visual.image_io` never pulls in torch.

Modules and the calls the server processes make:
- `visual.image_io` (API server): `await load_image(url, ImageLimits, FetchOptions)` for an OpenAI
  `image_url.url` (data: URI or http(s)), or `decode_image(bytes)`; every refusal is `ImageError`
  with a client-facing `reason` (map to HTTP 400).
- `visual.preprocess` (API server and visual server): `PreprocessConfig.from_pretrained(model_dir)`;
  `num_image_tokens(height, width, config)` gives the `<|image_pad|>` count before any pixel work;
  `preprocess_images(images, config) -> (pixel_values [N, 1536] f32, grid_thw [images, 3] int64)`,
  bit-identical to transformers' `Qwen2VLImageProcessorPil`.
- `visual.encoder` (visual server): `VisionEncoder.from_pretrained(model_dir, device, dtype)`, then
  `encode(pixel_values, grid_thw) -> (embeds [tokens, out_hidden], deepstack list)` and
  `split_per_image(embeds, grid_thw)`; `visual.qwen_vit` holds the modules, `visual.weights` the
  safetensors loader (`VisionCheckpointError` names missing/unexpected keys).

- `visual.server` (`run_visual`, spawned by appliance/launch.py for checkpoints with a vision
  tower):
  batches images across requests (`visual.pipeline`), keeps embeddings in a content-hash keyed
  shared-memory cache with LRU eviction and pinning (`visual.cache`), and reserves the worst-case
  ViT activation memory at startup (`visual.reservation`). The LLM-side splice and M-RoPE live in
  appliance/engine/mm_inputs.py and appliance/models/mrope.py.
"""
