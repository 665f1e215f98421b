// The tritonllm console: a chat playground over this server's OpenAI API and live charts of its metrics.
// Everything a model or the server sends is put on the page as text (textContent), never as HTML.
// The API key, when the server wants one, lives in this tab's sessionStorage only and goes out as a header.
"use strict";
(function () {
  const KEY_ITEM = "tritonllm-console-key";
  const $ = (id) => document.getElementById(id);
  // latencyModel: the served model whose TTFT and inter-token latency the charts show ("": all models).
  const state = { history: [], controller: null, charts: {}, summary: null, latencyModel: "", latencyModels: "",
                  refreshes: 0 };

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function showError(text) {
    const box = $("error");
    box.textContent = text || "";
    box.hidden = !text;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
      return JSON.stringify(body);
    } catch (e) {
      return response.status + " " + response.statusText;
    }
  }

  async function apiFailed(response) {
    const message = await errorText(response);
    if (response.status === 401) $("keybar").hidden = false;
    showError(message);
  }

  // ----- models ---------------------------------------------------------------------------------------
  async function loadModels() {
    const response = await fetch("/v1/models", { headers: headers(false), credentials: "same-origin" });
    if (!response.ok) { await apiFailed(response); return false; }
    const list = (await response.json()).data || [];
    const select = $("model");
    const previous = select.value;
    select.replaceChildren();
    for (const card of list) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.parent ? card.id + " (adapter of " + card.parent + ")" : card.id;
      select.appendChild(option);
    }
    if (list.some((card) => card.id === previous)) select.value = previous;
    select.dataset.loaded = String(list.length);
    showError("");
    return true;
  }

  // ----- chat -----------------------------------------------------------------------------------------
  function element(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Markdown: marked's lexer (a vendored library) reads the answer, and the page builds the elements itself with
  // textContent: no HTML from the model ever reaches the DOM (raw HTML in an answer is shown as its text), links
  // become text with their address (no model-chosen URL is ever followed).
  const BLOCK_TAGS = { paragraph: "p", blockquote: "blockquote" };
  const INLINE_TAGS = { strong: "strong", em: "em", del: "del" };

  function inline(tokens, parent) {
    for (const token of tokens || []) {
      if (INLINE_TAGS[token.type]) { inline(token.tokens, parent.appendChild(element(INLINE_TAGS[token.type]))); }
      else if (token.type === "codespan") { parent.appendChild(element("code", "", token.text)); }
      else if (token.type === "br") { parent.appendChild(document.createElement("br")); }
      else if (token.type === "link") { inline(token.tokens, parent); parent.appendChild(document.createTextNode(" <" + token.href + ">")); }
      else if (token.type === "text" && token.tokens) { inline(token.tokens, parent); }
      else { parent.appendChild(document.createTextNode(token.type === "escape" || token.type === "text" ? token.text : token.raw)); }
    }
  }

  function blocks(tokens, parent) {
    for (const token of tokens || []) {
      if (BLOCK_TAGS[token.type]) {
        const node = parent.appendChild(element(BLOCK_TAGS[token.type]));
        if (token.type === "blockquote") blocks(token.tokens, node); else inline(token.tokens, node);
      } else if (token.type === "heading") { inline(token.tokens, parent.appendChild(element("h" + Math.min(6, token.depth + 2)))); }
      else if (token.type === "code") { parent.appendChild(element("pre")).appendChild(element("code", "", token.text)); }
      else if (token.type === "list") {
        const list = parent.appendChild(element(token.ordered ? "ol" : "ul"));
        for (const item of token.items) blocks(item.tokens, list.appendChild(element("li")));
      } else if (token.type === "text") { inline(token.tokens || [token], parent.appendChild(element("p"))); }
      else if (token.type === "hr") { parent.appendChild(document.createElement("hr")); }
      else if (token.type !== "space") { parent.appendChild(element("p", "", token.raw)); }  // html, table, ...: as text
    }
  }

  function renderAnswer(node, text) {
    if (!window.marked) { node.textContent = text; return; }
    const out = document.createElement("div");
    try { blocks(window.marked.lexer(text), out); } catch (e) { out.replaceChildren(document.createTextNode(text)); }
    node.replaceChildren(...out.childNodes);
  }

  function addMessage(role, text) {
    const box = element("div", "message " + role);
    box.appendChild(element("div", "role", role));
    const reasoning = element("div", "reasoning");
    reasoning.hidden = true;
    box.appendChild(reasoning);
    box.appendChild(element("div", "content", text || ""));
    box.appendChild(element("div", "stats"));
    $("messages").appendChild(box);
    return box;
  }

  function numberOrNull(id) {
    const value = $(id).value.trim();
    return value === "" ? null : Number(value);
  }

  function requestBody(schema) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    const body = { model: $("model").value, messages: messages.concat(state.history), stream: true,
                   stream_options: { include_usage: true } };
    const temperature = numberOrNull("temperature");
    if (temperature !== null) body.temperature = temperature;
    const maxTokens = numberOrNull("max-tokens");
    if (maxTokens !== null) body.max_tokens = maxTokens;
    const seed = numberOrNull("seed");
    if (seed !== null) body.seed = seed;
    if (schema) body.response_format = { type: "json_schema", json_schema: { name: "console", schema: schema, strict: true } };
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.dataset.streaming = busy ? "1" : "0";
  }

  async function send(event) {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    let schema = null;
    const schemaText = $("schema").value.trim();
    if (schemaText) {
      try { schema = JSON.parse(schemaText); } catch (e) { showError("The JSON schema does not parse: " + e.message); return; }
    }
    showError("");
    state.history.push({ role: "user", content: text });
    addMessage("user", text);
    $("prompt").value = "";
    const box = addMessage("assistant", "");
    box.dataset.state = "streaming";
    const content = box.querySelector(".content");
    const reasoning = box.querySelector(".reasoning");
    const stats = box.querySelector(".stats");
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const started = performance.now();
    let first = null, last = null, chunks = 0, finish = null, usage = null, answer = "";
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true),
        body: JSON.stringify(requestBody(schema)), signal: controller.signal, credentials: "same-origin" });
      if (!response.ok) {
        await apiFailed(response);
        box.dataset.state = "error";
        state.history.pop();
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of frame.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) { showError(chunk.error.message || JSON.stringify(chunk.error)); finish = "error"; continue; }
            if (chunk.usage) usage = chunk.usage;
            for (const choice of chunk.choices || []) {
              const delta = choice.delta || {};
              const piece = (delta.content || "");
              const thought = (delta.reasoning_content || delta.reasoning || "");
              if (piece || thought) {
                const now = performance.now();
                if (first === null) first = now;
                last = now;
                chunks += 1;
              }
              if (thought) { reasoning.hidden = false; reasoning.textContent += thought; }
              if (piece) { answer += piece; renderAnswer(content, answer); }
              if (choice.finish_reason) finish = choice.finish_reason;
            }
          }
        }
        box.dataset.chunks = String(chunks);
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else { showError(String(e)); finish = "error"; }
    } finally {
      state.controller = null;
      setBusy(false);
    }
    if (answer) state.history.push({ role: "assistant", content: answer });
    const tokens = usage ? usage.completion_tokens : chunks;
    const parts = [];
    if (first !== null) parts.push("TTFT " + ((first - started) / 1000).toFixed(3) + " s");
    if (first !== null && last !== null && last > first && tokens > 1) {
      parts.push(((tokens - 1) / ((last - first) / 1000)).toFixed(1) + " tokens/s");
    }
    parts.push(tokens + " tokens");
    parts.push("finish: " + (finish || "none"));
    stats.textContent = parts.join(" · ");
    box.dataset.finish = finish || "none";
    if (schema && finish !== "stopped") {
      let ok = true;
      try { JSON.parse(answer); } catch (e) { ok = false; }
      box.appendChild(element("div", "json-check", ok ? "valid JSON" : "not valid JSON"));
      box.dataset.json = ok ? "valid" : "invalid";
    }
    box.dataset.state = "done";
    $("messages").scrollTop = $("messages").scrollHeight;
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // ----- charts ---------------------------------------------------------------------------------------
  const PALETTE = ["#2f6fde", "#d9534f", "#3aa655", "#e8a33d", "#8e5fc2", "#1aa3a3", "#c2558e", "#6b7a8f"];

  function chartWidth(node) {
    return Math.max(240, node.clientWidth - 4);
  }

  function draw(id, t, named) {
    const node = $(id);
    const names = Object.keys(named);
    const points = names.reduce((n, name) => n + named[name].filter((v) => v !== null && v !== undefined).length, 0);
    node.dataset.points = String(points);
    const signature = names.join("\u0000");
    let chart = state.charts[id];
    if (!chart || chart.signature !== signature) {
      if (chart) chart.plot.destroy();
      node.replaceChildren(element("div", "chart-title", node.dataset.title));
      if (!names.length) { node.appendChild(element("div", "empty", "no data yet")); delete state.charts[id]; return; }
      const series = [{}].concat(names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true })));
      const plot = new uPlot({ width: chartWidth(node), height: 160, series: series, scales: { x: { time: true } },
                               legend: { live: false } }, [t].concat(names.map((n) => named[n])), node);
      state.charts[id] = chart = { plot: plot, signature: signature, node: node };
      return;
    }
    chart.plot.setData([t].concat(names.map((n) => named[n])));
  }

  // The latency charts' model picker: "all models" (the server's own series) and every served model the summary
  // has latencies of (ttft_s_by_model, itl_s_by_model), rebuilt only when that list changes; the chosen model stays
  // chosen across refreshes (and listed, should it have no data left in the window).
  function updateLatencyModels(s) {
    const names = new Set(Object.keys(s.ttft_s_by_model || {}).concat(Object.keys(s.itl_s_by_model || {})));
    if (state.latencyModel) names.add(state.latencyModel);
    const models = [...names].sort();
    const signature = JSON.stringify(models);
    const select = $("latency-model");
    if (state.latencyModels !== signature) {
      const all = element("option", "", "all models");
      all.value = "";
      select.replaceChildren(all);
      for (const model of models) {
        const option = element("option", "", model);
        option.value = model;
        select.appendChild(option);
      }
      state.latencyModels = signature;
    }
    select.value = state.latencyModel;
    select.dataset.loaded = String(models.length);
  }

  function latencySeries(s, key) {
    if (!state.latencyModel) return s[key];
    const series = (s[key + "_by_model"] || {})[state.latencyModel];
    if (series) return series;
    const none = {};
    for (const name of Object.keys(s[key])) none[name] = s.t.map(() => null);
    return none;
  }

  function drawLatency(s) {
    for (const [id, key] of [["chart-ttft", "ttft_s"], ["chart-itl", "itl_s"]]) {
      draw(id, s.t, latencySeries(s, key));
      const node = $(id);
      const title = node.querySelector(".chart-title");
      if (title) title.textContent = node.dataset.title + ": " + (state.latencyModel || "all models");
      node.dataset.model = state.latencyModel;
    }
  }

  async function refreshCharts() {
    try {
      const response = await fetch("/console/summary.json", { headers: headers(false), credentials: "same-origin" });
      if (!response.ok) { $("charts-status").textContent = "(" + (await errorText(response)) + ")"; return; }
      const s = await response.json();
      state.summary = s;
      $("charts-status").textContent = "";
      draw("chart-tokens", s.t, s.tokens_per_s);
      draw("chart-requests", s.t, { "in flight": s.in_flight, queued: s.queued, waiting: s.waiting });
      updateLatencyModels(s);
      drawLatency(s);
      draw("chart-kv", s.t, s.kv_cache_usage);
      $("charts").dataset.updated = String(s.t.length);
      state.refreshes += 1;
      $("charts").dataset.refreshes = String(state.refreshes);
    } catch (e) {
      $("charts-status").textContent = "(" + String(e) + ")";
    }
  }

  function resizeCharts() {
    for (const id in state.charts) {
      const chart = state.charts[id];
      chart.plot.setSize({ width: chartWidth(chart.node), height: 160 });
    }
  }

  // ----- wiring ---------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", function () {
    $("send-form").addEventListener("submit", send);
    $("prompt").addEventListener("keydown", function (event) {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("send").click(); }
    });
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", function () { state.history = []; $("messages").replaceChildren(); });
    $("key-form").addEventListener("submit", async function (event) {
      event.preventDefault();
      sessionStorage.setItem(KEY_ITEM, $("api-key").value);
      $("api-key").value = "";
      if (await loadModels()) $("keybar").hidden = true;
    });
    $("latency-model").addEventListener("change", function () {
      state.latencyModel = $("latency-model").value;
      if (state.summary) drawLatency(state.summary);
    });
    window.addEventListener("resize", resizeCharts);
    loadModels();
    refreshCharts();
    setInterval(refreshCharts, 2000);
  });
})();
