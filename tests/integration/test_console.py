"""The browser console (issue 53) in a real browser: Debian's Chromium (/usr/bin/chromium, `make test-deps`) driven by
Playwright's Python API, against the session's real stack (tritonserver + frontends started here).

Two frontends on the session Triton, one browser for every check:
- `keyed`: API keys on, Triton's metrics relayed, serving the slow engine copy (>= 50 ms a step, so a stream
  lasts long enough on any machine to be seen growing and to be stopped mid-answer);
- `named`: two named models built from scripted checkpoints (tests/integration/scripted_model.py), one whose
  answer is `<img src=x onerror=...>` HTML, the other plain text: the model picker and the no-HTML-injection check.

Every wait is on DOM state the page sets (data-* attributes, text) or on the engine's own counters; none is a
fixed sleep. Screenshots of the chat and the charts at desktop and phone widths go to CONSOLE_SCREENSHOTS
(default: build/test-output/console/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from launcher.ports import find_free_port
from tests.integration.conftest import (REPO_ROOT, SLOW_MODEL, Stack, engine_metrics, start_frontend,
                                        wait_engine)
from tests.integration.scripted_model import _chain, write_scripted_checkpoint

import playwright.sync_api as playwright_api  # the dev extra

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SCREENSHOTS = Path(os.environ.get("CONSOLE_SCREENSHOTS", REPO_ROOT / "build" / "test-output" / "console"))
KEY = "sk-console-test"
HTML_MODEL, PLAIN_MODEL = "console-html", "console-plain"
HTML_TEXT = '<img src=x onerror="alert(1)">'  # no token twice in a scripted chain: one bare '=' only
PLAIN_TEXT = "Plain words."
USER_TEXT = "Say something in Chinese, with emoji."  # scripted_model.CHAT_MESSAGES: the chains start after it
WAIT_MS = 120_000  # a bound for a hung stack, not a speed
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

# No Chromium is a failure (every test here), naming the package: a skip would hide the untested page.
CHROMIUM_MISSING = None if Path(CHROMIUM).exists() else f"no Chromium at {CHROMIUM}: run `make test-deps` (Debian's chromium)"


@dataclass(frozen=True)
class Console:
    keyed: str  # http://127.0.0.1:<port> of the keyed frontend (slow engine)
    named: str  # of the frontend serving the two named scripted models


def build_named(stack: Stack, out: Path, checkpoints: Path, name: str, text: str) -> None:
    demo_dir = stack.scripted.demo.tokenizer_dir
    chain = _chain(demo_dir, text)
    assert chain.text == text, (chain.text, text)
    write_scripted_checkpoint(demo_dir, checkpoints / name, [chain])
    subprocess.run([sys.executable, "-m", "build_engine", "--model", str(checkpoints / name), "--name", name,
                    "--output-dir", str(out), "--max-batch-size", "4", "--max-seq-len", "256"], cwd=REPO_ROOT,
                   check=True, capture_output=True, text=True)
    # The session Triton serves its own repository: the named model joins it (a link) and is loaded there.
    (stack.repository / name).symlink_to(out / "models" / name, target_is_directory=True)
    httpx.post(f"{stack.triton_http_url}/v2/repository/models/{name}/load", headers=stack.triton_control,
               timeout=300).raise_for_status()


@pytest.fixture(scope="module")
def console(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    logs = tmp_path_factory.mktemp("console_logs")
    out, checkpoints = tmp_path_factory.mktemp("console_build"), tmp_path_factory.mktemp("console_checkpoints")
    build_named(stack, out, checkpoints, HTML_MODEL, HTML_TEXT)
    build_named(stack, out, checkpoints, PLAIN_MODEL, PLAIN_TEXT)
    control_key = logs / "triton-control-key"
    control_key.write_text(next(iter(stack.triton_control.values())))
    keyed_port, named_port = find_free_port(), find_free_port()
    keyed = start_frontend(stack.triton_grpc_url, keyed_port, logs / "keyed.log", ENGINE_MODEL=SLOW_MODEL,
                           SERVED_MODEL_NAME=stack.model, API_KEYS=KEY, TRITON_METRICS_URL=stack.triton_metrics_url,
                           TRITON_METRICS_CACHE_S="0")
    named = start_frontend(stack.triton_grpc_url, named_port, logs / "named.log", MODEL_REPOSITORY=str(out / "models"),
                           TRITON_CONTROL_KEY_FILE=str(control_key))
    try:
        for port, process in ((keyed_port, keyed), (named_port, named)):
            wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield Console(f"http://127.0.0.1:{keyed_port}", f"http://127.0.0.1:{named_port}")
    finally:
        stop_process(keyed)
        stop_process(named)
        for name in (HTML_MODEL, PLAIN_MODEL):
            httpx.post(f"{stack.triton_http_url}/v2/repository/models/{name}/unload", headers=stack.triton_control,
                       timeout=300)
            (stack.repository / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for every check of this module."""
    assert CHROMIUM_MISSING is None, CHROMIUM_MISSING
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def page(browser: Any, console: Console) -> Iterator[Any]:
    """The keyed frontend's console, key given, in one tab shared by the tests that follow each other here."""
    context = browser.new_context(viewport=DESKTOP)
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    tab.errors = []  # page errors and CSP reports: none may happen
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    tab.on("console", lambda message: tab.errors.append(message.text) if message.type == "error" and
           "Content Security Policy" in message.text else None)
    yield tab
    context.close()


def screenshot(tab: Any, name: str, viewport: dict[str, int], selector: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    tab.set_viewport_size(viewport)
    tab.locator(selector).screenshot(path=str(SCREENSHOTS / name))  # that part of the page, at that width


def last_answer(tab: Any) -> Any:
    return tab.locator(".message.assistant").last


def send(tab: Any, text: str, max_tokens: int, temperature: str = "0", schema: str = "") -> None:
    tab.fill("#max-tokens", str(max_tokens))
    tab.fill("#temperature", temperature)
    if schema:
        tab.locator("#schema-box summary").click()
        tab.fill("#schema", schema)
    else:
        tab.evaluate("document.getElementById('schema').value = ''")
    tab.fill("#prompt", text)
    count = tab.locator(".message.assistant").count()
    tab.click("#send")
    tab.wait_for_function(f"() => document.querySelectorAll('.message.assistant').length > {count}")


def wait_done(tab: Any) -> Any:
    answer = last_answer(tab)
    tab.wait_for_function("() => { const a = [...document.querySelectorAll('.message.assistant')].pop();"
                          " return a && a.dataset.state !== 'streaming'; }")
    return answer


def test_1_a_wrong_key_shows_the_server_error_and_the_right_key_opens_the_api(page: Any, console: Console) -> None:
    response = page.goto(console.keyed + "/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.wait_for_selector("#keybar:not([hidden])")  # /v1/models said 401: the page asks for a key
    assert "didn't provide an API key" in page.text_content("#error")
    page.fill("#api-key", "sk-wrong")
    page.click("#key-save")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('Incorrect API key provided')")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#keybar[hidden]", state="attached")
    assert page.input_value("#model") == "demo-tiny"
    assert page.evaluate("window.location.href").find(KEY) < 0
    assert page.evaluate("Object.keys(localStorage).length") == 0  # the key is in sessionStorage only
    assert page.evaluate("Object.values(sessionStorage)") == [KEY]


def test_2_streamed_text_grows_and_the_answer_reports_ttft_speed_and_finish(page: Any) -> None:
    # Every length the answer's text takes on screen, recorded by the page itself as it changes (no polling).
    page.evaluate("""() => {
        window.seenLengths = [];
        new MutationObserver(() => {
            const answer = [...document.querySelectorAll('.message.assistant')].pop();
            if (answer) window.seenLengths.push(answer.querySelector('.content').textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    send(page, "Hello there", max_tokens=48)
    answer = wait_done(page)
    lengths = [n for n in page.evaluate("window.seenLengths") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # it grew, piece by piece
    stats = answer.locator(".stats").text_content()
    assert "TTFT" in stats and "tokens/s" in stats and "finish: " in stats, stats
    assert answer.get_attribute("data-finish") in ("length", "stop")


def test_3_stop_cancels_the_request_mid_answer(page: Any, stack: Stack) -> None:
    before = engine_metrics(stack.triton_metrics_url, SLOW_MODEL)["cancelled_requests_total"]
    send(page, "Tell me a long story", max_tokens=400)  # >= 20 s on the slow engine
    page.wait_for_function("() => Number([...document.querySelectorAll('.message.assistant')].pop().dataset.chunks || 0) >= 3")
    page.click("#stop")
    answer = wait_done(page)
    assert answer.get_attribute("data-finish") == "stopped"
    stopped_text = answer.locator(".content").text_content()
    wait_engine(stack.triton_metrics_url, SLOW_MODEL, lambda v: v["cancelled_requests_total"] > before,
                "the engine to count the stopped request as cancelled")
    # The engine has ended the request: nothing more can arrive, and nothing did.
    assert answer.locator(".content").text_content() == stopped_text
    assert int(answer.get_attribute("data-chunks")) < 400
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_4_a_json_schema_answer_parses(page: Any) -> None:
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
              "additionalProperties": False}
    send(page, "How do you feel?", max_tokens=200, temperature="1", schema=json.dumps(schema))
    answer = wait_done(page)
    assert answer.get_attribute("data-json") == "valid", (answer.text_content(), page.text_content("#error"))
    assert json.loads(answer.locator(".content").text_content())["mood"] in ("happy", "sad")


def test_5_the_charts_draw_non_empty_series_after_traffic(page: Any) -> None:
    for chart in ("chart-tokens", "chart-requests", "chart-ttft", "chart-itl", "chart-kv"):
        page.wait_for_function(f"() => Number(document.getElementById('{chart}').dataset.points || 0) > 0")
    # uPlot drew them: a canvas per chart, and the tokens/s series has a positive value over the last minutes
    assert page.locator("#charts canvas").count() >= 5
    summary = page.evaluate("fetch('/console/summary.json').then(r => r.json())")
    assert max(summary["tokens_per_s"]["demo-tiny"]) > 0
    assert any(v is not None for v in summary["ttft_s"]["p50"])
    screenshot(page, "chat-desktop.png", DESKTOP, "#chat")
    screenshot(page, "charts-desktop.png", DESKTOP, "#charts")
    screenshot(page, "chat-phone.png", PHONE, "#chat")
    screenshot(page, "charts-phone.png", PHONE, "#charts")
    # phone-sized: one column, nothing wider than the window
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    assert page.errors == []


def test_6_the_latency_charts_show_the_chosen_models_percentiles(page: Any, stack: Stack) -> None:
    page.set_viewport_size(DESKTOP)
    assert page.input_value("#latency-model") == ""  # all models: the server's own series
    page.wait_for_function("(model) => [...document.querySelectorAll('#latency-model option')]"
                           ".some(o => o.value === model)", arg=stack.model)
    options = page.eval_on_selector_all("#latency-model option", "os => os.map(o => [o.value, o.textContent])")
    assert options[0] == ["", "all models"] and [stack.model, stack.model] in options, options
    page.select_option("#latency-model", stack.model)
    for chart in ("chart-ttft", "chart-itl"):  # redrawn at once from the last summary, with this model's series
        page.wait_for_function("([id, model]) => { const c = document.getElementById(id);"
                               " return c.dataset.model === model && Number(c.dataset.points || 0) > 0; }",
                               arg=[chart, stack.model])
    assert stack.model in page.text_content("#chart-ttft .chart-title")
    summary = page.evaluate("fetch('/console/summary.json').then(r => r.json())")
    assert any(v is not None for v in summary["ttft_s_by_model"][stack.model]["p50"])
    assert any(v is not None for v in summary["itl_s_by_model"][stack.model]["p50"])
    assert len(summary["ttft_s_by_model"][stack.model]["p95"]) == len(summary["t"])
    # the choice outlives the next refreshes of the charts
    seen = int(page.get_attribute("#charts", "data-refreshes"))
    page.wait_for_function(f"() => Number(document.getElementById('charts').dataset.refreshes) > {seen + 1}")
    assert page.input_value("#latency-model") == stack.model
    assert page.get_attribute("#chart-ttft", "data-model") == stack.model
    screenshot(page, "charts-per-model-desktop.png", DESKTOP, "#charts")
    page.select_option("#latency-model", "")
    page.wait_for_function("() => document.getElementById('chart-ttft').dataset.model === ''")
    assert page.errors == []


def test_7_a_second_model_is_picked_and_model_html_is_shown_as_text(browser: Any, console: Console) -> None:
    context = browser.new_context(viewport=DESKTOP)
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    dialogs: list[str] = []
    tab.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        tab.goto(console.named + "/")
        tab.wait_for_function("() => Number(document.getElementById('model').dataset.loaded || 0) >= 2")
        assert sorted(tab.eval_on_selector_all("#model option", "os => os.map(o => o.value)")) == \
            sorted([HTML_MODEL, PLAIN_MODEL])
        tab.select_option("#model", PLAIN_MODEL)
        send(tab, USER_TEXT, max_tokens=32)
        assert wait_done(tab).locator(".content").text_content() == PLAIN_TEXT
        tab.click("#clear")  # the scripted chains answer the one-message conversation
        tab.select_option("#model", HTML_MODEL)
        send(tab, USER_TEXT, max_tokens=32)
        answer = wait_done(tab)
        assert answer.locator(".content").text_content() == HTML_TEXT
        assert tab.locator("#messages img").count() == 0  # text, not an element
        assert dialogs == []
        screenshot(tab, "html-as-text.png", DESKTOP, "#chat")
    finally:
        context.close()
