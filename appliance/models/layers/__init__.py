"""Shared building blocks: TP-aware linear layers, norms, rotary, attention, Gated DeltaNet, MoE."""
