"""The detokenizer process loop: RouterOutput from the router in, DetokOutput to the server out, and
FinishRequest back to the router when a stop string matches.

Spawned by appliance/launch.py (`run_detokenizer`); the logic itself is `Detokenizer`
(detokenizer.py).
"""

from __future__ import annotations

import zmq

from appliance.detokenizer.detokenizer import Detokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.ipc import Addresses, RoleLink, child_init, zmq_socket
from appliance.logging import get_logger
from appliance.messages import DetokOutput, RouterOutput, decoder, encode

logger = get_logger(__name__)


def run_detokenizer(model_dir: str, addrs: Addresses) -> None:
    child_init("detokenizer")
    link = RoleLink(addrs.launcher, "detokenizer")
    link.progress("loading tokenizer")
    detok = Detokenizer(TextTokenizer.from_pretrained(model_dir))
    ctx = zmq.Context.instance()
    inbox = zmq_socket(ctx, zmq.PULL, addrs.detokenizer, bind=True)
    to_server = zmq_socket(ctx, zmq.PUSH, addrs.server, bind=False)
    to_router = zmq_socket(ctx, zmq.PUSH, addrs.router, bind=False)
    link.ready()
    dec = decoder(RouterOutput)
    reported_live = 0
    while True:
        out, finishes = detok.process(dec.decode(inbox.recv(copy=False)))
        for finish in finishes:
            to_router.send(encode(finish))
        if out.deltas or detok.num_live != reported_live:
            reported_live = detok.num_live
            to_server.send(encode(DetokOutput(out.deltas, reported_live)))
