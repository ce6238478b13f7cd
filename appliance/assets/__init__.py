"""Model assets: which checkpoint folder a model argument names (a folder, a Hugging Face Hub id
resolved through the Hub cache, or the embedded tiny default model, built on first use).

Called by the CLI, the offline `LLM` and benchmarks, through `resolve.resolve_model_dir`.
"""
