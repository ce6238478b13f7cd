"""Test support: randomisation, tiny Qwen3.5 checkpoints, offline tokenizers, HF oracles.

Imported by tests and by `appliance.assets` (embedded demo model); never by serving code paths.
"""
