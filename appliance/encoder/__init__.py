"""Visual server role ("visual"): encodes the images of requests between the API server and the
router, around the `visual` library (decode, preprocess, ViT, embedding cache, shared memory).

`run_visual` (process.py) is the process entry the launcher spawns; `VisualPipeline` (pipeline.py)
is the request bookkeeping, unit-tested without sockets; startup.py holds whether the role runs
(`wants_visual_server`) and its ViT reservation as the launcher's VisualInfo. This file imports
nothing, so the torch-free API server can import startup.py alone.
"""
