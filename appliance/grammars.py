"""Grammar compilation for structured outputs (issue 18) on xgrammar: one compiler per process
over the checkpoint's tokenizer, compiled grammars cached by guide, compiled on a thread pool
(xgrammar releases the GIL while it compiles, so a compile never stalls the caller's loop).

Used by the server (appliance/server/guides.py compiles each request's guide before submitting it:
the 400 for a bad schema, the compile metrics) and by the worker (engine/guided.py compiles its
own copy on admission and keeps one matcher per request). xgrammar is an optional dependency
(`pip install 'appliance[structured]'`); without it a request that needs it gets one clear 400.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from appliance.messages import Guide

CACHE_SIZE = 512  # compiled grammars kept per process (least recently used evicted)
COMPILE_THREADS = 2
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
GUIDE_KINDS = ("json_schema", "regex", "grammar", "structural_tag")
# string formats xgrammar enforces (the standard's others it leaves unenforced: the server refuses
# them, appliance/server/guides.py)
ENFORCED_FORMATS = frozenset(
    {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
    | {"uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
)


class GrammarUnavailable(RuntimeError):
    """The grammar library is not installed (a request asked for structured output)."""


class GrammarError(ValueError):
    """An invalid schema, regex or grammar; the message names the problem."""


def xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError:
        raise GrammarUnavailable(
            "structured outputs need the xgrammar package, which is not installed on this "
            "server (pip install 'appliance[structured]')"
        ) from None
    return xgr


@dataclass
class CompileStats:
    """Cumulative, for /debug/status and the Prometheus counters."""

    compiled: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0
    errors: int = 0  # guides that failed to compile
    compile_seconds: float = 0.0  # summed over compiles


class GrammarCompiler:
    """Guide -> xgrammar CompiledGrammar, cached by (kind, spec), compiled on a thread pool."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],  # -> a transformers tokenizer (called once, lazily)
        vocab_size: int,  # the logits' width (the model's vocab, >= the tokenizer's)
        stop_token_ids: Sequence[int] | None = None,  # None: the tokenizer's eos
        on_compiled: Callable[[float], None] | None = None,  # compile seconds, per miss
        on_cache_hit: Callable[[], None] | None = None,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids) if stop_token_ids is not None else None
        self._on_compiled = on_compiled
        self._on_cache_hit = on_cache_hit
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._compiler: Any = None
        self.stats = CompileStats()

    def submit(self, guide: Guide) -> Future:
        """The compiled grammar of `guide` as a future (a cached one when seen before); its
        exception is a GrammarError or GrammarUnavailable."""
        key = (guide.kind, guide.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                if self._on_cache_hit is not None:
                    self._on_cache_hit()
                return future
            future = self._pool.submit(self._compile, guide.kind, guide.spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def warm_up(self) -> None:
        """Builds the tokenizer info now (seconds on a 248k vocabulary) instead of on first use."""
        self._xgr_compiler()

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_ids,
                )
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._xgr_compiler()  # GrammarUnavailable propagates as is
        start = time.perf_counter()
        try:
            compiled = _compile_with(compiler, kind, spec)
        except GrammarError:
            self.stats.errors += 1
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses
            self.stats.errors += 1
            raise GrammarError(f"{kind}: {_clean(exc)}") from None
        seconds = time.perf_counter() - start
        self.stats.compiled += 1
        self.stats.compile_seconds += seconds
        if self._on_compiled is not None:
            self._on_compiled(seconds)
        return compiled


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n], which lets raw
# control characters (invalid in JSON: json.loads refuses them) into the string; its unbounded
# strings exclude them. Patched in the EBNF text until the library does it.
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_schema_ebnf(schema: Any) -> str:
    """The EBNF of compact JSON (no free whitespace: a model cannot pad its answer with endless
    blanks) following `schema` (JSON text or a parsed schema), without raw control characters."""
    xgr = xgrammar()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    return str(grammar).replace(_BOUNDED_CHARS, _JSON_CHARS)


# a structural tag's `json_schema` of this style (the appliance's own) is a string schema's text
# without its quotes: a tool-call string parameter with a `format`, raw as the XML format has it
RAW_STRING_STYLE = "appliance_raw_string"
_QUOTED_ROOT = 'root ::= (("\\"" root_1 "\\""))'


def raw_string_ebnf(schema: Any) -> str:
    """The EBNF of a string schema's (a `format`'s) characters, without the JSON quotes."""
    ebnf = json_schema_ebnf(schema)
    if _QUOTED_ROOT not in ebnf.splitlines():
        raise GrammarError(f"tools: cannot write {json.dumps(schema)[:200]} as raw text")
    return ebnf.replace(_QUOTED_ROOT, "root ::= ((root_1))", 1)


def _json_formats_as_grammars(node: Any) -> Any:
    """A structural tag with every JSON-style `json_schema` format replaced by its EBNF."""
    if isinstance(node, list):
        return [_json_formats_as_grammars(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style") == RAW_STRING_STYLE:
        return {"type": "grammar", "grammar": raw_string_ebnf(node["json_schema"])}
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": json_schema_ebnf(node["json_schema"])}
    return {key: _json_formats_as_grammars(value) for key, value in node.items()}


def _compile_with(compiler: Any, kind: str, spec: str) -> Any:
    if kind == "json_schema":
        return compiler.compile_grammar(json_schema_ebnf(spec))
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        if "::=" not in spec:  # no EBNF rule: Lark (vLLM takes both), its rules open at `start`
            return compiler.compile_lark(spec)
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        tag = _json_formats_as_grammars(json.loads(spec))
        return compiler.compile_structural_tag(json.dumps(tag))
    raise GrammarError(f"guide: unknown kind {kind!r}, expected one of {', '.join(GUIDE_KINDS)}")


def _clean(exc: Exception) -> str:
    """The library's message without its "[time] file.cc:line: " prefix, first line only."""
    text = str(exc).strip() or type(exc).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0])[:500]
