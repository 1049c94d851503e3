// braid's playground: a chat over /v1/chat/completions, streamed. Plain browser JavaScript,
// no dependencies: the page must work with no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const history = []; // the conversation so far: {role, content}
let model = null; // the served model's name, from /v1/models
let running = null; // the AbortController of the reply being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text) {
  $("status").textContent = text || "";
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) {
    // not JSON: fall through to the status line
  }
  return response.status + " " + response.statusText;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) {
      $("model-name").textContent = "(model unknown)";
      setStatus(r.status === 401 ? "This server needs its API key: type it above." : await errorText(r));
      return;
    }
    const body = await r.json();
    model = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = model || "(no model)";
    setStatus("");
  } catch (e) {
    setStatus("The server cannot be reached: " + e.message);
  }
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(label, content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  if (v === "") return fallback;
  const n = Number(v);
  return Number.isFinite(n) ? n : fallback;
}

function requestBody(messages) {
  const body = {
    model: model || undefined,
    messages: messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Math.max(1, Math.floor(numberOr("max-tokens", 256))),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = Math.floor(seed);
  if ($("json-mode").checked) {
    // Parsed here so a typo is shown before anything is sent.
    const schema = JSON.parse($("json-schema").value);
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: schema } };
  }
  return body;
}

// Yields each SSE event's data (the text after "data: ") as it arrives.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

function figuresText(f) {
  const parts = [];
  if (f.completion !== null) parts.push(f.completion + " tokens");
  if (f.rate !== null) parts.push(f.rate.toFixed(1) + " tokens/s");
  if (f.ttft !== null) parts.push("first token " + Math.round(f.ttft) + " ms");
  if (f.prompt !== null) parts.push("cached prompt tokens " + f.cached + "/" + f.prompt);
  if (f.finish) parts.push("finish: " + f.finish);
  return parts.join(" · ");
}

async function send(text) {
  let body;
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: text });
  try {
    body = requestBody(messages);
  } catch (e) {
    setStatus("The JSON schema is not valid JSON: " + e.message);
    return;
  }
  setStatus("");
  addMessage("user", text);
  history.push({ role: "user", content: text });
  const box = addMessage("assistant", "");
  box.dataset.state = "streaming";
  const content = box.querySelector(".content");
  const figures = document.createElement("div");
  figures.className = "figures";
  box.append(figures);

  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  const f = { completion: null, rate: null, ttft: null, prompt: null, cached: 0, finish: null };
  let first = null;
  let last = null;
  let reply = "";
  let failure = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server failed the request");
      for (const choice of chunk.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          reply += delta;
          content.textContent = reply;
          box.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) f.finish = choice.finish_reason;
        if (choice.error) failure = choice.error.message || "the request failed";
      }
      if (chunk.usage) {
        f.completion = chunk.usage.completion_tokens;
        f.prompt = chunk.usage.prompt_tokens;
        const details = chunk.usage.prompt_tokens_details;
        f.cached = (details && details.cached_tokens) || 0;
      }
    }
  } catch (e) {
    failure = e.name === "AbortError" ? "stopped" : e.message;
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  if (first !== null) {
    f.ttft = first - started;
    // Decode speed: the tokens after the first over the time they took.
    if (f.completion !== null && f.completion > 1 && last > first) {
      f.rate = ((f.completion - 1) * 1000) / (last - first);
    } else if (f.completion !== null) {
      f.rate = (f.completion * 1000) / (performance.now() - started);
    }
  }
  figures.textContent = figuresText(f);
  if (failure) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = failure;
    box.append(err);
  }
  if (failure && !reply) {
    history.pop(); // nothing came back: the next message does not follow this one
  } else {
    history.push({ role: "assistant", content: reply });
  }
  box.dataset.state = failure ? "failed" : "done";
}

function init() {
  const saved = sessionStorage.getItem("braid-api-key");
  if (saved) $("api-key").value = saved;
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("braid-api-key", $("api-key").value.trim());
    loadModel();
  });
  for (const [id, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
    $(id).addEventListener("input", () => ($(out).textContent = $(id).value));
  }
  $("json-mode").addEventListener("change", () => {
    $("json-schema").disabled = !$("json-mode").checked;
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message-input").value.trim();
    if (!text || running) return;
    $("message-input").value = "";
    send(text);
  });
  $("message-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
    setStatus("");
  });
  loadModel();
}

init();
