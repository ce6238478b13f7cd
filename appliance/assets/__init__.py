"""Embedded assets: the tiny default model that `appliance` serves when no model path is given.

Called by the engine runner (`appliance.engine.runner`) and the CLI.
"""
