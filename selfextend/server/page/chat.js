// The chat page: sends the whole conversation to /v1/chat/completions and streams the reply (SSE).
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} of every finished turn, the system prompt excluded
let controller = null;

$("key").value = localStorage.getItem("selfextend-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("selfextend-key", $("key").value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// "1 token", "2 tokens" (as the command line's summaries count).
function plural(n, word) {
  return `${n} ${n === 1 ? word : word + "s"}`;
}

// The line under a reply: its counts and rates from the response's selfextend fields.
function statsText(s, tokens) {
  return `${plural(tokens, "token")}, ${s.tokens_per_second.toFixed(1)} tokens/s, ` +
    `first token after ${s.ttft_s.toFixed(2)} s, ${plural(s.shifts, "context shift")}, ` +
    `${plural(s.cached_tokens, "prompt token")} reused (${s.moved_tokens} moved), slot ${s.slot}`;
}

function statsLine(s, tokens) {
  const div = document.createElement("div");
  div.className = "stats";
  div.textContent = statsText(s, tokens);
  $("log").appendChild(div);
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  add("user", text);
  history.push({ role: "user", content: text });
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
  const reply = add("assistant", "");
  let tokens = 0;
  let stats = null;
  controller = new AbortController();
  busy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        messages,
        stream: true,
        temperature: Number($("temperature").value),
        max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, end).trim();
        buffer = buffer.slice(end + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          reply.textContent += delta.content;
          tokens += 1;
          reply.scrollIntoView({ block: "end" });
        }
        if (chunk.selfextend) stats = chunk.selfextend;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      reply.classList.add("error");
      reply.textContent += (reply.textContent ? "\n" : "") + "error: " + e.message;
    }
  } finally {
    controller = null;
    busy(false);
  }
  history.push({ role: "assistant", content: reply.textContent });
  if (stats) statsLine(stats, tokens);
  else {
    const div = document.createElement("div");
    div.className = "stats";
    div.textContent = `stopped after ${tokens} pieces of text`;
    $("log").appendChild(div);
  }
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("log").textContent = "";
});

fetch("/v1/models", { headers: headers() })
  .then((r) => r.json())
  .then((m) => {
    const d = m.data && m.data[0];
    if (d) $("model").textContent = `${d.id}, ${d.meta.n_parallel} slot${d.meta.n_parallel === 1 ? "" : "s"} of ${d.meta.n_ctx} cells`;
  })
  .catch(() => {});
