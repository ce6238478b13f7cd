"""Ops used by the models: each `<op>.py` holds the torch reference `<op>_ref()` and (where
written) the Triton kernel with its launcher. The bottom of the import stack: imports nothing from
`appliance` or `visual`; callers pass their flags to `appliance_kernels.backends.configure`."""
