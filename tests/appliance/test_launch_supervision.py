"""The launcher's supervision names the role that died first: a role's exit wakes its wait at
once, so a TP peer that aborts on the broken collective a few ms later is not the one reported
(tests/e2e/test_role_failures.py kills worker 1 and expects worker 1 in the error)."""

from __future__ import annotations

import multiprocessing as mp
import time

import zmq

from appliance.launch import Launcher
from appliance.messages import ToLauncher, decoder


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_the_first_role_to_die_is_reported():
    ctx = zmq.Context.instance()
    launcher = Launcher.__new__(Launcher)  # only the supervision's state: no roles of its own
    launcher._inbox = ctx.socket(zmq.PULL)
    launcher._inbox.bind("inproc://launch-supervision-test")
    launcher._failures = {}
    launcher._decoder = decoder(ToLauncher)
    fork = mp.get_context("fork")
    # "worker 0" is listed first but dies 80 ms after "worker 1", as a gloo peer aborts
    launcher._procs = {
        "worker 0": fork.Process(target=_sleep, args=(0.68,)),
        "worker 1": fork.Process(target=_sleep, args=(0.6,)),
    }
    try:
        t0 = time.monotonic()
        for proc in launcher._procs.values():
            proc.start()
        dead = None
        while dead is None and time.monotonic() - t0 < 20:
            assert launcher._poll(10_000) is None  # no messages: only a death ends the wait
            dead = launcher._dead_role()
        assert dead is not None and dead.startswith("worker 1 "), dead
        assert time.monotonic() - t0 < 5, "the wait did not end when the role died"
    finally:
        for proc in launcher._procs.values():
            proc.join(5)
        launcher._inbox.close()
