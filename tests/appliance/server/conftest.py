"""Server tests: the real FastAPI app and engine client, wired over ZMQ to a scripted in-test engine
(a thread standing in for router + worker) whose tokens pass through the real Detokenizer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import zmq
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from appliance.config import ServerConfig
from appliance.detokenizer.detokenizer import Detokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import (
    AbortRequest,
    DetokRegister,
    FinishRequest,
    PrefixCacheReset,
    PromptLogprobs,
    ResetPrefixCache,
    RouterOutput,
    RouterStats,
    RouterStatus,
    SchedulerStats,
    StatusQuery,
    TokenizedRequest,
    TokenUpdate,
    ToRouter,
    decoder,
    encode,
)
from appliance.metrics import MetricsRecorder
from appliance.server.app import build_app
from appliance.server.engine_client import EngineClient
from appliance.server.prompts import PromptBuilder
from appliance.server.state import ServerState

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
CORPUS = [
    "hello world, this is a small test corpus for the server tests.",
    "The quick brown fox jumps over the lazy dog. STOP here.",
] * 20
MAX_MODEL_LEN = 256


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


class ScriptedEngine(threading.Thread):
    """Router + worker stand-in. Each request "generates" `script(prompt_ids)` one token per step,
    then eos (finish "stop"), or stops at max_tokens ("length")."""

    def __init__(
        self,
        router_addr: str,
        server_addr: str,
        tokenizer: PreTrainedTokenizerFast,
        script: Callable[[list[int]], list[int]],
        step_s: float = 0.002,
    ) -> None:
        super().__init__(daemon=True)
        self.script = script
        self.step_s = step_s
        self.detok = Detokenizer(TextTokenizer(tokenizer))
        self.eos = tokenizer.eos_token_id
        ctx = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(router_addr)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.connect(server_addr)
        self.active: dict[str, list] = {}  # req_id -> [request, tokens emitted]
        self.received: list[TokenizedRequest] = []
        self.aborted: list[str] = []
        self.finished_by_detok: list[str] = []
        self.reject_status = 0  # set to 429/400 to reject every new request
        self.resets = 0  # ResetPrefixCache messages received
        # its answer's freed_tokens, freed_snapshots, kept_tokens, kept_snapshots
        self.reset_counts = (40, 3, 8, 1)
        self._halt = threading.Event()

    def run(self) -> None:
        dec = decoder(ToRouter)
        while not self._halt.is_set():
            registers, updates, answers = [], [], []
            while self.inbox.poll(0 if self.active else 5):
                msg = dec.decode(self.inbox.recv())
                if isinstance(msg, TokenizedRequest):
                    self.received.append(msg)
                    if self.reject_status:
                        updates.append(
                            TokenUpdate(
                                msg.req_id,
                                [],
                                "error",
                                error="rejected",
                                error_status=self.reject_status,
                            )
                        )
                        continue
                    self.active[msg.req_id] = [msg, 0]
                    registers.append(
                        DetokRegister(msg.req_id, len(msg.prompt_token_ids), msg.detok)
                    )
                elif isinstance(msg, AbortRequest):
                    self.aborted.append(msg.req_id)
                    self.active.pop(msg.req_id, None)
                elif isinstance(msg, FinishRequest):
                    self.finished_by_detok.append(msg.req_id)
                    self.active.pop(msg.req_id, None)
                elif isinstance(msg, StatusQuery):
                    answers.append(RouterStatus(msg.query_id, self.stats()))
                elif isinstance(msg, ResetPrefixCache):
                    self.resets += 1
                    answers.append(PrefixCacheReset(msg.query_id, True, *self.reset_counts))
            for req_id, entry in list(self.active.items()):
                updates.append(self._step(req_id, entry))
            if registers or updates:
                out, finishes = self.detok.process(RouterOutput(registers, updates))
                self.finished_by_detok += [f.req_id for f in finishes]
                for f in finishes:
                    self.active.pop(f.req_id, None)
                self.outbox.send(encode(out))
            for answer in answers:  # the router answers the server directly
                self.outbox.send(encode(answer))
            if self.active:
                time.sleep(self.step_s)

    @staticmethod
    def _prompt_logprobs(req: TokenizedRequest, done: int) -> PromptLogprobs | None:
        """With the first token: every prompt token after the first scores -1.0 (itself its only
        alternative)."""
        k = req.sampling.prompt_logprobs
        if k is None or done:
            return None
        rest = req.prompt_token_ids[1:]
        top = [[(t, -1.0)][:k] for t in rest]
        return PromptLogprobs(0, req.prompt_token_ids, [None] + [-1.0] * len(rest), [[], *top])

    def _step(self, req_id: str, entry: list) -> TokenUpdate:
        req, done = entry
        prompt_logprobs = self._prompt_logprobs(req, done)
        if req.max_tokens == 0:
            del self.active[req_id]
            return TokenUpdate(req_id, [], "length", prompt_logprobs=prompt_logprobs)
        tokens = self.script(req.prompt_token_ids)
        token = tokens[done] if done < len(tokens) else self.eos
        entry[1] = done + 1
        logprobs = None
        top = None
        if req.sampling.logprobs is not None:
            logprobs = [-0.25]
            top = [[(token, -0.25), (self.eos, -2.0)][: req.sampling.logprobs]]
        finish = None
        if token == self.eos and not req.ignore_eos:
            finish = "stop"
        elif entry[1] >= req.max_tokens:
            finish = "length"
        if finish is not None:
            del self.active[req_id]
        return TokenUpdate(req_id, [token], finish, logprobs, top, prompt_logprobs=prompt_logprobs)

    def stats(self) -> RouterStats:
        n = len(self.active)
        return RouterStats(
            scheduler=SchedulerStats(
                num_running=n, num_waiting=0, kv_used=n, kv_total=8, state_used=n, state_total=8
            )
        )

    def stop(self) -> None:
        self._halt.set()
        self.join(2)
        self.inbox.close()
        self.outbox.close()


def asgi_scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """An HTTP scope for driving the app's ASGI interface directly (chunked bodies, a client
    that disconnects mid-stream: what TestClient cannot do)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def default_script(tokenizer):
    reply = tokenizer.encode("hello world héllo", add_special_tokens=False)
    return lambda prompt: reply


@pytest.fixture
def make_server(tmp_path, tokenizer):
    """make_server(script=None, **server_config) -> (TestClient, ScriptedEngine, ServerState)."""
    made = []

    def make(script=None, max_open: int = 64, ready: bool = True, **config):
        router_addr = f"ipc://{tmp_path}/router-{len(made)}"
        server_addr = f"ipc://{tmp_path}/server-{len(made)}"
        engine = ScriptedEngine(
            router_addr, server_addr, tokenizer, script or default_script(tokenizer)
        )
        engine.start()
        metrics = MetricsRecorder("tiny")
        server_config = ServerConfig(access_log=False, **config)
        state = ServerState(
            config=server_config,
            model_name="tiny",
            model_dir="/models/tiny",
            prompts=PromptBuilder(tokenizer, MAX_MODEL_LEN, server_config.max_prompt_chars),
            client=EngineClient(router_addr, server_addr, max_open, metrics),
            metrics=metrics,
            ready=ready,
        )
        client = TestClient(build_app(state))
        client.__enter__()
        made.append((client, engine))
        return client, engine, state

    yield make
    for client, engine in made:
        client.__exit__(None, None, None)
        engine.stop()
