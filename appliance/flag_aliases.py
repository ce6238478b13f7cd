"""vLLM's and SGLang's spellings of this appliance's settings: the ones it takes as aliases (the
command line's flags, the offline LLM's keywords) and the ones that mean something else here,
named with this appliance's nearest setting. Read by cli.py and offline/llm.py; imports nothing."""

from __future__ import annotations

# vLLM / SGLang spellings of the same settings: accepted as aliases of this appliance's flags
FLAG_ALIASES = {
    "tp": ("--tensor-parallel-size", "--tp-size"),
    "disable_cuda_graph": ("--enforce-eager",),
}
# theirs that mean something else here: an unknown-flag error names the nearest of ours
FLAG_HINTS = {
    "--gpu-memory-utilization": "--mem-fraction (the share of free memory after the weights that "
    "the KV and state pools take)",
    "--mem-fraction-static": "--mem-fraction (the share of free memory after the weights that "
    "the KV and state pools take)",
    "--model": "the positional MODEL (appliance serve MODEL)",
    "--model-path": "the positional MODEL (appliance serve MODEL)",
    "--speculative-num-steps": "--mtp-step",
}
