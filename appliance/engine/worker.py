"""The worker process loop: one per TP rank; receives every StepPlan from the router, runs it on its
ModelRunner (up to two steps in flight), and (rank 0 only) sends each StepResult back in order.

Spawned by appliance/launch.py (`run_worker`). torch.distributed (gloo on CPU, NCCL on GPU) is
initialised here, before the runner loads its TP shard.
"""

from __future__ import annotations

import importlib
import sys
import time

import zmq

from appliance.config import EngineConfig
from appliance.ipc import Addresses, RoleLink, child_init, zmq_socket
from appliance.logging import get_logger
from appliance.messages import StepPlan, decoder, encode

logger = get_logger(__name__)

SPIN_S = 20e-6  # wait between checks for a new plan or the running step's end


def load_runner_class(path: str) -> type:
    """'package.module:ClassName' -> the class (the real ModelRunner, or a test/bench stand-in)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _init_distributed(config: EngineConfig, addrs: Addresses, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    device = config.parallel.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=addrs.dist_init, rank=rank, world_size=world_size)
    logger.debug("rank %d/%d joined the %s group", rank, world_size, backend)


def run_worker(
    config: EngineConfig,
    addrs: Addresses,
    rank: int,
    world_size: int,
    runner_path: str,
    reserved_bytes: int = 0,  # device bytes the visual server holds for ViT activations
) -> None:
    child_init(f"worker {rank}")
    link = RoleLink(addrs.launcher, "worker", rank)
    if world_size > 1:
        link.progress(f"joining the tensor-parallel group ({world_size} ranks)")
        _init_distributed(config, addrs, rank, world_size)
    link.progress("loading model")
    extra = {"reserved_bytes": reserved_bytes} if reserved_bytes else {}
    runner = load_runner_class(runner_path)(config, rank, world_size, **extra)
    ctx = zmq.Context.instance()
    inbox = zmq_socket(ctx, zmq.PULL, addrs.workers[rank], bind=True)
    results = zmq_socket(ctx, zmq.PUSH, addrs.router_results, bind=False) if rank == 0 else None
    info = None
    if rank == 0:
        info = runner.info()
    link.ready(info)
    try:
        serve_steps(runner, inbox, results)
    except RuntimeError as exc:  # torch.distributed's DistBackendError among them
        if world_size == 1 or not peer_lost(exc):
            raise
        # a symptom of another rank's death, which the launcher names and acts on: one line
        first = (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0]
        logger.error("worker %d: a tensor-parallel peer is gone (%s); exiting", rank, first)
        sys.exit(1)


# what a collective raises when another rank died mid-step (gloo's TCP pairs; NCCL's remote error)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def peer_lost(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in PEER_LOST)


def serve_steps(runner, inbox: zmq.Socket, results: zmq.Socket | None) -> None:
    """Plans in, results out, in order. While a step runs on the device the loop waits for the
    next plan *or* that step's end, whichever comes first: a plan that arrives in time is launched
    behind the running step (so the device never idles between them), and a finished step is
    reported at once."""
    dec = decoder(StepPlan)

    def report() -> None:
        result = runner.collect()
        if results is not None:
            results.send(encode(result))

    while True:
        if runner.num_pending and not inbox.poll(0):
            if runner.oldest_done():
                report()
            else:
                time.sleep(SPIN_S)
            continue
        runner.submit(dec.decode(inbox.recv(copy=False)))
        while runner.num_pending > 1:
            report()
