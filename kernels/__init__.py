"""Ops used by the models: each `<op>.py` holds the torch reference `<op>_ref()` and (where
written) the
Triton kernel with its launcher. Imports nothing from `appliance` or `visual`."""
