"""Every guide a request carries, compiled by the frontend before any engine sees it (issue 26).

Why (tests/trtllm_contract/rules.py GUIDE_FAILS_THE_BATCH): TensorRT-LLM compiles a request's guide inside its
executor loop (guidedDecoder.cpp GuidedDecoder::build, from trtGptModelInflightBatching::forwardAsync); a guide
xgrammar cannot compile throws there, and executorImpl.cpp forwardAsync answers EVERY active request with
"Encountered an error in forwardAsync function: ...". One client's bad regex fails every user. So each guide
(response_format, the tool schemas of tool_choice required / named, guided_json, guided_regex, guided_grammar:
everything frontend/planning/structured.py turns into a `Guide`) is compiled here first, with the installed
xgrammar's tokenizer-free compilation (`Grammar.from_json_schema` with TensorRT-LLM's defaults, `from_regex`,
`from_ebnf`: every refusal seen in the differential corpus happens there, none in the tokenizer step after it),
and one that does not compile is a 400 naming its field, with xgrammar's reason (one line, bounded).

Versions. The frontend runs the CPU engine's xgrammar (0.2.9, pyproject.toml); the GPU image
(tritonserver 25.12-trtllm = TensorRT-LLM 1.1.0) runs 0.1.25 (tensorrt_llm 1.1.0's PKG-INFO on PyPI:
`Requires-Dist: xgrammar==0.1.25`; the C++ runtime's vendored copy moved to v0.1.25 in the same change,
NVIDIA/TensorRT-LLM#7893, and stayed there until #12016). Both versions were run over one corpus of schemas,
regexes and grammars (issue 26's report). What 0.1.25 refuses and 0.2.9 accepts is refused here too
(`older_xgrammar_problem`):
- regex: an empty alternative, except the last one of a group. 0.1.25: `a|`, `|a`, `a||b`, `(|a)`, `(a||b)`
  fail ("EBNF parser error ...: Expect element, but got |"); `(a|)`, `()` pass. 0.2.9 accepts all.
- JSON schema `pattern` (and patternProperties keys): 0.2.9 sends patterns through another converter that
  accepts look-ahead (and then ignores it), group modifiers `(?i)`, `(?P<n>...)` and possessive `a++`, `a?+`;
  0.1.25 refuses them ("Lookahead is not supported yet.", "Group modifier flag is not supported yet.", "Two
  consecutive repetition modifiers are not allowed."). So each pattern must also pass 0.2.9's `from_regex`,
  which refuses exactly these, and the empty-alternative rule (in a pattern 0.1.25 accepts a leading or
  trailing empty alternative at the top: `a|`, `|a`; not `a||b`, not `(|a)`).
- JSON schema `$ref` with JSON-pointer escapes or percent-encoding (`#/$defs/a~1b`, `#/$defs/a%20b`): 0.1.25
  looks the field up undecoded ("Cannot find field"); 0.2.9 decodes it.
- EBNF: the macros 0.2.9 added (`Regex(...)`, `Substring(...)`, `Token(...)`, `ExcludeToken(...)`,
  `TokenTagDispatch(...)`); 0.1.25 reads them as undefined rules ("Rule \"Regex\" is not defined").
- (`anyOf: []` / `oneOf: []`, also 0.1.25-only refusals, are not JSON schemas: structured.py's check.)
What 0.2.9 refuses and 0.1.25 accepts (a `$ref` cycle with no content, a `$ref` ending in "/", TagDispatch's
`stop_str`/`stop_eos`, `multipleOf: 0`) is refused here as well: the check is at least as strict as either.

Bounds. Size: structured.py bounds every guide's text (MAX_GUIDE_BYTES). Time: compiles run on a few daemon
threads of their own (`threads`), never on the event loop; a compile that takes longer than `timeout_s` is a
400 saying so (and stays refused: it would stall the GPU's executor step as long). A thread cannot be killed,
so a pathological guide holds one thread until xgrammar returns, and no more: a request for a guide already
compiling joins that compile. At most MAX_PENDING distinct guides wait or compile at once, and none waits for
a thread longer than QUEUE_WAIT_S: past either, 429 with Retry-After. Outcomes (compiled, or the refusal) are
cached in an LRU keyed by (type, sha256 of the text).

Guided decoding off. An engine whose guided decoding is off (EngineMetadata.guided_decoding: TensorRT-LLM with
an empty guided_decoding_backend or xgrammar_tokenizer_info_path generates guided requests UNGUIDED, without
a word) makes every guided request a 400 naming the field (structured.refuse_unguided), before the compile.

Without xgrammar installed the frontend cannot check a guide, and refuses guided requests (400) rather than
let an unchecked guide reach an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import queue
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from frontend.generation.engine import Guide
from frontend.api_types.errors import invalid_request, too_many_requests
from frontend.planning.guide_budget import NewGuideBudget
from frontend.planning.sampling import is_trtllm
from frontend.planning.structured import refuse_unguided

try:  # a frontend installed without xgrammar (and the torch it imports) refuses guided requests
    import xgrammar as xgr
except ImportError:  # pragma: no cover - the dev venv has it
    xgr = None

log = logging.getLogger("frontend")

COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 2.0
CACHE_SIZE = 4096  # outcomes only (a flag or a short message), keyed by a hash: a few hundred KB at most
MAX_PENDING = 64  # distinct guides waiting for a compile thread or compiling
QUEUE_WAIT_S = 10.0  # longest wait for a compile thread (all of them busy with slow guides)
MAX_REASON_CHARS = 300
METADATA_TTL_S = 30.0  # how long an engine's "guided decoding on/off" is reused before it is asked again
GUIDES_PER_MINUTE = 60  # new guides per TensorRT-LLM model per minute (guide_budget.py; GUIDES_PER_MINUTE)
GPU_XGRAMMAR = "0.1.25"  # TensorRT-LLM 1.1.0's (nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3)
KINDS = {"json": "JSON", "json_schema": "JSON schema", "regex": "regex", "ebnf_grammar": "grammar"}

Compile = Callable[[str, str], "str | None"]  # (type, text) -> None (compiles) or the reason it does not


class GuideRefused(Exception):
    """A guide that does not compile; str() is the reason, one line."""


# ----- the compile itself (runs on a compile thread) -----------------------------------------------------
# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: " and may hold a "Check failed" clause.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line
    text = _XGRAMMAR_PREFIX.sub("", text) or type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


def compile_guide(guide_type: str, text: str) -> str | None:
    """None when the guide compiles, with this xgrammar and with the GPU image's older one (as far as the
    differential corpus tells, see the module docstring); else the reason, one line."""
    if xgr is None:
        return ("this frontend has no xgrammar installed and cannot check guides; guided decoding needs it "
                "(pip install xgrammar==0.2.9)")
    try:
        if guide_type == "json":
            return None
        if guide_type == "json_schema":
            xgr.Grammar.from_json_schema(text)  # TensorRT-LLM: CompileJSONSchema(guide), its defaults
        elif guide_type == "regex":
            xgr.Grammar.from_regex(text)
        elif guide_type == "ebnf_grammar":
            xgr.Grammar.from_ebnf(text)
        else:
            return f"unknown guide type {guide_type!r}"
    except Exception as exc:  # xgrammar raises RuntimeError (and a few others) with the parser's message
        return _reason(exc)
    return older_xgrammar_problem(guide_type, text)


def older_xgrammar_problem(guide_type: str, text: str) -> str | None:
    """What the GPU image's xgrammar (0.1.25) refuses in a guide the installed one (0.2.9) compiled; None if
    nothing. Each rule and its evidence: the module docstring."""
    older = f" (xgrammar {GPU_XGRAMMAR}, TensorRT-LLM's, refuses it)"
    if guide_type == "regex":
        at = empty_alternative(text, pattern=False)
        return None if at is None else f"an empty alternative at position {at}{older}; write (x)? for x|"
    if guide_type == "ebnf_grammar":
        macro = newer_ebnf_macro(text)
        return None if macro is None else f"{macro}(...) is not in its EBNF{older}"
    if guide_type != "json_schema":
        return None
    schema = json.loads(text)
    for pattern in _schema_strings(schema, "pattern"):
        try:
            xgr.Grammar.from_regex(pattern)
        except Exception as exc:
            return f"pattern {_quoted(pattern)}: {_reason(exc)}{older}"
        at = empty_alternative(pattern, pattern=True)
        if at is not None:
            return f"pattern {_quoted(pattern)}: an empty alternative at position {at}{older}"
    for ref in _schema_strings(schema, "$ref"):
        if "~" in ref or "%" in ref:
            return f"$ref {_quoted(ref)}: escaped (~0, ~1) or percent-encoded references{older}; rename the definition"
    return None


def _quoted(text: str, limit: int = 60) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "...", ensure_ascii=False)


_GROUP_PREFIX = re.compile(r"\?(?:P?<[A-Za-z_][A-Za-z0-9_]*>|<[=!]|[:=!>])")


def empty_alternative(regex: str, pattern: bool) -> int | None:
    """Where the first empty alternative xgrammar 0.1.25 refuses is (an index into `regex`), or None.
    0.1.25 accepts an empty alternative only as the last one of a group, `(a|)`; in a JSON schema `pattern`
    also as the first or last one at the top, `|a`, `a|` (not `a||b`). Escapes and character classes are
    skipped as xgrammar reads them (a class ends at its first unescaped `]`)."""
    groups: list[int] = []  # for each open group, the alternative index of the enclosing level
    index, empty, i, n = 0, True, 0, len(regex)
    while i < n:
        char = regex[i]
        if char == "\\":
            i, empty = i + 2, False
        elif char == "[":
            i += 1
            while i < n and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
            i, empty = i + 1, False
        elif char == "(":
            groups.append(index)
            index, empty = 0, True
            prefix = _GROUP_PREFIX.match(regex, i + 1)
            i = prefix.end() if prefix else i + 1
        elif char == ")":
            if groups:  # the group's last alternative may be empty; the group itself is content
                index = groups.pop()
            i, empty = i + 1, False
        elif char == "|":
            if empty and (groups or not pattern or index > 0):
                return i
            index, empty, i = index + 1, True, i + 1
        else:
            i, empty = i + 1, False
    if empty and index > 0 and not groups and not pattern:
        return n
    return None


NEWER_EBNF_MACROS = ("Regex", "Substring", "Token", "ExcludeToken", "TokenTagDispatch")
_EBNF_SKIP = re.compile(r'"(?:[^"\\]|\\.)*"?|\[(?:[^\]\\]|\\.)*\]?|#[^\n]*', re.DOTALL)
_EBNF_MACRO = re.compile(r"(?<![A-Za-z0-9_.-])(" + "|".join(NEWER_EBNF_MACROS) + r")\s*\(")


def newer_ebnf_macro(grammar: str) -> str | None:
    """The first of 0.2.9's EBNF macros the grammar calls (outside strings, classes and comments), or None."""
    match = _EBNF_MACRO.search(_EBNF_SKIP.sub(lambda m: " " * len(m.group()), grammar))
    return match.group(1) if match else None


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values that are data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _schema_strings(node: Any, keyword: str) -> Iterator[str]:
    """Every string value of `keyword` in a schema's subschemas (patternProperties' keys count as patterns)."""
    if isinstance(node, list):
        for item in node:
            yield from _schema_strings(item, keyword)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            continue
        if key == keyword and isinstance(value, str):
            yield value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            if key == "patternProperties" and keyword == "pattern":
                yield from value.keys()
            for subschema in value.values():
                yield from _schema_strings(subschema, keyword)
        else:
            yield from _schema_strings(value, keyword)


# ----- the checker: threads, bounds, cache -----------------------------------------------------------------
@dataclass(eq=False)
class _Job:
    """One distinct guide compiling or waiting for a thread; every request that asks for it waits on it."""
    future: Future
    submitted_at: float
    started_at: float | None = None


@dataclass(eq=False)
class GuideChecker:
    threads: int = COMPILE_THREADS
    timeout_s: float = COMPILE_TIMEOUT_S
    cache_size: int = CACHE_SIZE
    max_pending: int = MAX_PENDING
    queue_wait_s: float = QUEUE_WAIT_S
    compile: Compile = compile_guide
    hits: int = 0
    misses: int = 0
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _pending: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _workers: list = field(default_factory=list)

    async def check(self, guides: Sequence[Guide]) -> None:
        """Each guide compiles, in order; else a 400 naming the first one's field (429 while the compile
        threads are saturated)."""
        for guide in guides:
            reason = await self.outcome(guide.type, guide.text)
            if reason is not None:
                raise invalid_request(f"{guide.param}: the {KINDS.get(guide.type, guide.type)} does not compile: "
                                      f"{reason}", guide.param)

    async def outcome(self, guide_type: str, text: str) -> str | None:
        """None when the guide compiles, else the reason (from the cache when it was seen lately)."""
        key = (guide_type, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
        with self._lock:
            if key in self._cache:
                self.hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
            job = self._pending.get(key)
            if job is None:
                if len(self._pending) >= self.max_pending:
                    raise too_many_requests(f"{len(self._pending)} guides are being compiled; retry later",
                                            self.timeout_s)
                self.misses += 1
                job = self._pending[key] = _Job(Future(), time.monotonic())
                self._start_workers()
                self._queue.put((key, job, guide_type, text))
        return await self._wait(job)

    async def _wait(self, job: _Job) -> str | None:
        waiter = asyncio.wrap_future(job.future)  # never cancelled here: other requests may wait on the job
        while True:
            now = time.monotonic()
            if job.started_at is None:
                left = job.submitted_at + self.queue_wait_s - now
                if left <= 0:
                    raise too_many_requests("every guide-compile thread is busy; retry later", self.timeout_s)
                left = min(left, self.timeout_s)  # look again whether it started
            else:
                left = job.started_at + self.timeout_s - now
                if left <= 0:
                    return self._too_slow()
            done, _ = await asyncio.wait({waiter}, timeout=left)
            if done:
                return waiter.result()

    def _too_slow(self) -> str:
        return (f"it took longer than {self.timeout_s:g} s to compile (an engine would stall every request "
                f"while it compiled); simplify it")

    def _start_workers(self) -> None:  # under the lock
        while len(self._workers) < self.threads:
            worker = threading.Thread(target=self._work, name=f"guide-check-{len(self._workers)}", daemon=True)
            self._workers.append(worker)  # daemon: a compile that never ends never holds up the exit
            worker.start()

    def _work(self) -> None:
        while True:
            key, job, guide_type, text = self._queue.get()
            job.started_at = started = time.monotonic()
            try:
                reason = self.compile(guide_type, text)
            except Exception as exc:  # not the guide's fault, as far as anyone knows: still an answer
                log.exception("checking a guide of type %r failed", guide_type)
                reason = f"the check failed: {_reason(exc)}"
            if time.monotonic() - started > self.timeout_s:
                reason = self._too_slow()
            with self._lock:
                self._cache[key] = reason
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                del self._pending[key]
            with contextlib.suppress(InvalidStateError):  # nobody cancels it; a loop shut down might have
                job.future.set_result(reason)


def checker_of(state: Any) -> GuideChecker:
    """The app's checker (app.state.guide_checker), made on first use from its settings."""
    checker = getattr(state, "guide_checker", None)
    if checker is None:
        settings = getattr(state, "settings", None)
        checker = GuideChecker(threads=getattr(settings, "guide_compile_threads", COMPILE_THREADS),
                               timeout_s=getattr(settings, "guide_compile_timeout_s", COMPILE_TIMEOUT_S))
        state.guide_checker = checker
    return checker


_guided_decoding: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> (on, when asked)


async def guided_decoding_on(engine: Any) -> bool:
    """Whether the engine model applies guides (EngineMetadata.guided_decoding), asked at most every
    METADATA_TTL_S per engine (a model reloaded with its tokenizer info fixed is seen within that);
    None (unit tests' contexts) counts as on."""
    return (await _engine_facts(engine))[0]


async def _engine_facts(engine: Any) -> tuple[bool, bool]:
    """(guided decoding on, TensorRT-LLM) for the engine model, asked at most every METADATA_TTL_S."""
    if engine is None:
        return True, False
    try:
        known = _guided_decoding.get(engine)
    except TypeError:  # an engine that cannot be a weak key (a test's): asked every time
        known = None
    if known is not None and time.monotonic() - known[2] < METADATA_TTL_S:
        return known[0], known[1]
    metadata = await engine.metadata()
    on = bool(getattr(metadata, "guided_decoding", True))
    trtllm = is_trtllm(str(getattr(metadata, "log_probs", "model")))
    with contextlib.suppress(TypeError):
        _guided_decoding[engine] = (on, trtllm, time.monotonic())
    return on, trtllm


async def check_guides(state: Any, engine: Any, guide: Guide | None, parts: Sequence[Guide] = ()) -> None:
    """Before the engine sees the request: guided decoding on at the engine, and the guide (after the
    schemas it is made of, `parts`, each under its own field) compiling. A 400 naming the field otherwise.
    On TensorRT-LLM, a guide the model has not seen must also fit its budget of new guides (guide_budget.py):
    429 with Retry-After otherwise."""
    if guide is None:
        return
    on, trtllm = await _engine_facts(engine)
    refuse_unguided(guide, on)
    await checker_of(state).check([*parts, guide])
    if trtllm:
        model = str(getattr(engine, "model", None) or getattr(engine, "engine_model", None) or "")
        key = f"{guide.type}:{hashlib.sha256(guide.text.encode()).hexdigest()}"
        wait = budget_of(state).admit(model, key)
        if wait is not None:
            error = too_many_requests(
                f"{guide.param}: this model's engine (TensorRT-LLM) compiles each new guide while every request on "
                f"it waits, and keeps it for good; it has met {budget_of(state).limit} new guides in the last "
                f"{budget_of(state).window_s:g} s (GUIDES_PER_MINUTE). Retry later, or reuse a schema already sent",
                wait, type="invalid_request_error", code="guide_rate_exceeded")
            error.param = guide.param
            raise error


def budget_of(state: Any) -> NewGuideBudget:
    """The app's budget of new guides per model (app.state.guide_budget), made on first use from its settings."""
    budget = getattr(state, "guide_budget", None)
    if budget is None:
        budget = NewGuideBudget(getattr(getattr(state, "settings", None), "guides_per_minute", GUIDES_PER_MINUTE))
        state.guide_budget = budget
    return budget
