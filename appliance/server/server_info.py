"""SGLang's `GET /get_server_info` (and its newer name `/server_info`): the launch settings under
SGLang's names where this server has one, `version`, and `internal_states`, one entry (one data
parallel rank) with `last_gen_throughput` (generated tokens/s of the last stats window that
generated any, as SGLang's last decode log line; 0.0 before one, or with
APPLIANCE_LOG_STATS_INTERVAL 0) and `avg_spec_accept_length` (tokens per MTP verify step since
start, the bonus token included; None with MTP off or before a verify step). SGLang's
bench_serving and its test and eval scripts read the accept length there.

No secret is in it (no API key) and `model_path` is the served name, never the folder's path on
the host (as /get_model_info). Called by app.py; the settings are built once by build_state.
"""

from __future__ import annotations

from typing import Any

from appliance import __version__
from appliance.config import ServeConfig
from appliance.messages import SchedulerStats


def launch_args(config: ServeConfig, model_name: str) -> dict[str, Any]:
    """The settings of this launch under SGLang's ServerArgs names (context_length is filled per
    answer: the checkpoint's when the flag leaves it 0)."""
    engine, server = config.engine, config.server
    mtp = engine.scheduler.mtp_step
    graphs = engine.graphs
    return {
        "model_path": model_name,
        "tokenizer_path": model_name,
        "served_model_name": model_name,
        "host": server.host,
        "port": server.port,
        "tp_size": engine.parallel.tp,
        "dp_size": 1,
        "pp_size": 1,
        "dtype": engine.model.dtype,
        "load_format": engine.model.load_format,
        "quantization": engine.model.quantization or None,
        "kv_cache_dtype": engine.cache.kv_cache_dtype,
        "random_seed": engine.model.seed,
        "max_running_requests": engine.scheduler.max_num_seqs,
        "max_queued_requests": engine.scheduler.max_waiting,
        "chunked_prefill_size": engine.scheduler.max_num_batched_tokens,
        "schedule_policy": engine.scheduler.scheduling_policy,
        "disable_radix_cache": not engine.scheduler.prefix_caching,
        "page_size": 1,
        "attention_backend": engine.kernels.attention_backend,
        "disable_cuda_graph": graphs.disable_cuda_graph,
        "cuda_graph_max_bs": graphs.cuda_graph_max_bs or engine.scheduler.max_num_seqs,
        "speculative_algorithm": "NEXTN" if mtp else None,
        "speculative_num_steps": mtp or None,
        "speculative_eagle_topk": 1 if mtp else None,
        "speculative_num_draft_tokens": mtp + 1 if mtp else None,
        "enable_metrics": True,
    }


def server_info(
    args: dict[str, Any],
    context_length: int,
    stats: SchedulerStats,
    last_gen_throughput: float,
) -> dict[str, Any]:
    """The answer, from the launch settings and the router's snapshot."""
    accept = stats.mtp_mean_accept_len if stats.mtp_drafts else None
    state = {"last_gen_throughput": last_gen_throughput, "avg_spec_accept_length": accept}
    return {
        **args,
        "context_length": context_length,
        "version": __version__,
        "internal_states": [state],
    }
