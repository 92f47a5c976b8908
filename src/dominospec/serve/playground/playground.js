// The dominospec playground: a chat that streams each answer with its tokens marked by source (the
// server's spec_metrics extension), a plain-decoding comparison of the same question ("speculative":
// false), and a panel read from /metrics. Everything it calls is this server's own API.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "dominospec-api-key";
const METRICS_EVERY_MS = 2000;
const WINDOW_MS = 60000; // the verify budget is averaged over the last minute

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  model: null,
  messages: [], // the conversation so far: {role, content}
  last: null, // the last exchange: {history, answer element, speculative result}
  busy: false,
  samples: [], // /metrics samples: {t, cycles, drafted}
  polling: null,
};

class KeyNeeded extends Error {}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: headers() });
  if (r.status === 401) {
    askKey(state.key ? "That key was refused." : "");
    throw new KeyNeeded();
  }
  return r;
}

function askKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("send").disabled = true;
  $("key").focus();
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(x, digits = 1) {
  return x === null || x === undefined || !isFinite(x) ? "-" : x.toFixed(digits);
}

// ----- connecting -----

async function connect() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(`GET /v1/models answered ${r.status}`);
    state.model = (await r.json()).data[0].id;
  } catch (err) {
    if (!(err instanceof KeyNeeded)) $("model").textContent = "cannot reach the server: " + err.message;
    return;
  }
  $("key-form").hidden = true;
  $("model").textContent = state.model;
  $("send").disabled = state.busy;
  if (!state.polling) {
    pollMetrics();
    state.polling = setInterval(pollMetrics, METRICS_EVERY_MS);
  }
}

// ----- one streamed answer -----

// Stream one chat answer into `column`; resolves to {text, tokens, seconds, spec} (null on failure).
async function stream(messages, extra, column) {
  const out = column.querySelector(".text");
  const stats = column.querySelector(".stats");
  const body = {
    model: state.model,
    messages,
    max_tokens: parseInt($("max-tokens").value, 10) || 128,
    temperature: parseFloat($("temperature").value) || 0,
    stream: true,
    spec_metrics: true,
    ...extra,
  };
  const t0 = performance.now();
  const live = { text: "", tokens: 0, closed: 0, cycles: 0, drafted: 0, spec: null, first: null, failed: null };
  const show = () => {
    const seconds = (performance.now() - t0) / 1000;
    const tau = live.spec ? live.spec.tau : live.closed ? live.tokens / live.closed : null;
    const cycles = live.spec ? live.spec.cycles : live.cycles;
    const drafted = live.spec ? live.spec.drafted : live.drafted;
    const line =
      `${live.tokens} tokens · ${fmt(live.tokens / seconds)} tok/s · tau ${fmt(tau, 2)} · ` +
      `${fmt(cycles ? drafted / cycles : null, 2)} drafts verified per cycle` +
      (live.first !== null ? ` · first token after ${fmt(live.first * 1000, 0)} ms` : "");
    stats.textContent = line;
    $("live").textContent = `${extra.speculative === false ? "plain" : "speculative"}: ${line}`;
  };
  const handle = (data) => {
    if (data === "[DONE]") return;
    const event = JSON.parse(data);
    if (event.error) {
      live.failed = event.error.message;
      return;
    }
    if (event.usage) {
      live.tokens = event.usage.completion_tokens;
      live.spec = event.usage.spec_metrics || null;
    }
    const choice = event.choices && event.choices[0];
    if (!choice) return;
    const pieces = choice.spec_tokens || (choice.delta && choice.delta.content ? [[choice.delta.content, null]] : []);
    for (const [text, source] of pieces) {
      if (live.first === null) live.first = (performance.now() - t0) / 1000;
      out.append(el("span", source ? "tok src-" + source : "tok", text));
      live.text += text;
      live.tokens += 1;
      if (source === "target") live.closed += 1;
    }
    if (choice.spec_progress) {
      live.cycles = choice.spec_progress.cycles;
      live.drafted = choice.spec_progress.drafted;
    }
  };
  const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body) });
  if (!r.ok) {
    const e = await r.json().catch(() => ({}));
    stats.textContent = "";
    out.append(el("span", "error", (e.error && e.error.message) || `the server answered ${r.status}`));
    return null;
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      for (const line of buffer.slice(0, end).split("\n")) if (line.startsWith("data: ")) handle(line.slice(6));
      buffer = buffer.slice(end + 2);
    }
    show();
  }
  show();
  if (live.failed) {
    out.append(el("span", "error", " [" + live.failed + "]"));
    return null;
  }
  column.classList.add("done");
  return { text: live.text, tokens: live.tokens, seconds: (performance.now() - t0) / 1000, spec: live.spec };
}

function answerColumn(answer, title) {
  const column = el("div", "column");
  column.append(el("h4", "", title), el("div", "text"), el("div", "stats"));
  answer.append(column);
  return column;
}

async function busy(work) {
  state.busy = true;
  $("send").disabled = $("compare").disabled = true;
  try {
    await work();
  } catch (err) {
    if (!(err instanceof KeyNeeded)) $("live").textContent = "failed: " + err.message;
  } finally {
    state.busy = false;
    $("send").disabled = !state.model;
    $("compare").disabled = !state.last || state.last.compared;
  }
}

function send(event) {
  event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question || state.busy) return;
  busy(async () => {
    state.messages.push({ role: "user", content: question });
    const history = state.messages.slice();
    $("conversation").append(el("div", "user", question));
    const answer = el("div", "answer");
    $("conversation").append(answer);
    $("prompt").value = "";
    // a fresh seed per question: at temperature > 0, asking again gives another answer; the comparison
    // with plain decoding reuses it
    const seed = Math.floor(Math.random() * 2 ** 31);
    const result = await stream(history, { seed }, answerColumn(answer, "speculative"));
    state.messages.push({ role: "assistant", content: result ? result.text : "" });
    state.last = result ? { history, answer, result, seed, compared: false } : null;
  });
}

function compare() {
  const last = state.last;
  if (!last || last.compared || state.busy) return;
  busy(async () => {
    last.compared = true;
    const plain = await stream(last.history, { speculative: false, seed: last.seed }, answerColumn(last.answer, "plain decoding"));
    if (!plain) return;
    const a = last.result.tokens / last.result.seconds;
    const b = plain.tokens / plain.seconds;
    const line = el("p", "comparison", `speculative ${fmt(a)} tok/s · plain ${fmt(b)} tok/s · ${fmt(a / b, 2)}x`);
    last.answer.after(line);
  });
}

// ----- the server panel (/metrics) -----

function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) values[m[1] + (m[2] || "")] = parseFloat(m[3]);
  }
  return values;
}

async function pollMetrics() {
  let values;
  try {
    const r = await api("/metrics");
    if (!r.ok) throw new Error(`GET /metrics answered ${r.status}`);
    values = parseMetrics(await r.text());
    $("server-error").textContent = "";
  } catch (err) {
    if (!(err instanceof KeyNeeded)) $("server-error").textContent = err.message;
    return;
  }
  $("running").textContent = fmt(values.dominospec_active_rows, 0);
  $("queued").textContent = fmt(values.dominospec_queue_depth, 0);
  $("slots").textContent = fmt(values.dominospec_max_batch, 0);
  $("server-tau").textContent = values.dominospec_tau ? fmt(values.dominospec_tau, 2) : "-";
  const now = performance.now();
  state.samples.push({
    t: now,
    cycles: values.dominospec_spec_cycles_total || 0,
    drafted: values.dominospec_drafts_verified_total || 0,
  });
  while (state.samples.length > 2 && now - state.samples[1].t > WINDOW_MS) state.samples.shift();
  const first = state.samples[0];
  const last = state.samples[state.samples.length - 1];
  const cycles = last.cycles - first.cycles;
  $("budget").textContent = cycles > 0 ? fmt((last.drafted - first.drafted) / cycles, 2) : "-";
  drawBudget();
  drawAcceptance(values);
}

function drawBudget() {
  // one point per polling interval with cycles in it: drafts verified per request-cycle then
  const svg = $("budget-chart");
  const points = [];
  for (let i = 1; i < state.samples.length; i++) {
    const a = state.samples[i - 1];
    const b = state.samples[i];
    if (b.cycles > a.cycles) points.push([b.t, (b.drafted - a.drafted) / (b.cycles - a.cycles)]);
  }
  svg.replaceChildren();
  if (points.length < 1) return;
  const top = Math.max(1, ...points.map((p) => p[1]));
  const now = performance.now();
  const svgNS = "http://www.w3.org/2000/svg";
  const xy = points.map(([t, v]) => [200 * (1 - (now - t) / WINDOW_MS), 38 - 36 * (v / top)]);
  const line = document.createElementNS(svgNS, "polyline");
  line.setAttribute("points", xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
  svg.append(line);
  for (const [x, y] of xy) {
    const dot = document.createElementNS(svgNS, "rect"); // a mark per interval, visible even alone
    dot.setAttribute("x", (x - 1.5).toFixed(1));
    dot.setAttribute("y", (y - 1.5).toFixed(1));
    dot.setAttribute("width", "3");
    dot.setAttribute("height", "3");
    svg.append(dot);
  }
}

function drawAcceptance(values) {
  const rates = [];
  for (const [name, v] of Object.entries(values)) {
    const m = name.match(/^dominospec_acceptance_by_position\{position="(\d+)"\}$/);
    if (m) rates[parseInt(m[1], 10) - 1] = v;
  }
  const bars = $("acceptance");
  bars.replaceChildren();
  if (!rates.length) {
    bars.append(el("p", "muted", "no speculative cycle yet"));
    return;
  }
  rates.forEach((rate, k) => {
    const bar = el("div", "bar");
    const track = el("div", "track");
    const fill = el("div", "fill");
    fill.style.width = `${Math.round(100 * (rate || 0))}%`;
    track.append(fill);
    bar.append(el("span", "", `k=${k + 1}`), track, el("span", "", fmt(rate, 2)));
    bars.append(bar);
  });
}

// ----- wiring -----

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", send);
  $("compare").addEventListener("click", compare);
  $("clear").addEventListener("click", () => {
    if (state.busy) return;
    state.messages = [];
    state.last = null;
    $("conversation").replaceChildren();
    $("live").textContent = "";
    $("compare").disabled = true;
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.key);
    connect();
  });
  connect();
});
