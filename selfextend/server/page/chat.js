// The chat page: sends the whole conversation to /v1/chat/completions and streams the reply (SSE).
"use strict";

const $ = (id) => document.getElementById(id);
// {role, content} of every turn the model answered, the system prompt excluded: a refused message and
// error text never go in (the model would read them back as the conversation)
const turns = [];
let controller = null;
let stopped = false;  // the Stop button, not an error, ended the reply
let conversation = 0;  // "New chat" starts the next one: a reply of an earlier one writes nothing

$("key").value = localStorage.getItem("selfextend-key") || "";
$("key").addEventListener("input", () => {
  localStorage.setItem("selfextend-key", $("key").value);
  showModel();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

// Scroll so that `el`'s end shows above the input bar (which sits over the page's bottom edge).
function follow(el) {
  document.documentElement.style.scrollPaddingBottom = $("form").offsetHeight + "px";
  el.scrollIntoView({ block: "end" });
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.dir = "auto";
  div.textContent = text;
  $("log").appendChild(div);
  follow(div);
  return div;
}

function note(text) {
  const div = document.createElement("div");
  div.className = "stats";
  div.textContent = text;
  $("log").appendChild(div);
  follow(div);
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

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// The settings as numbers, or a sentence saying which one is not (an empty field read as 0).
function settings() {
  const temperature = $("temperature").value.trim();
  const maxTokens = $("max-tokens").value.trim();
  if (temperature === "" || !Number.isFinite(Number(temperature))) {
    return "Temperature must be a number, 0 or more (0: always the likeliest token)";
  }
  if (maxTokens === "" || !Number.isInteger(Number(maxTokens))) {
    return "Max tokens must be a whole number, 1 or more";
  }
  return { temperature: Number(temperature), max_tokens: Number(maxTokens) };
}

async function send(text, asked) {
  const mine = conversation;
  const user = add("user", text);
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(turns, [
    { role: "user", content: text },
  ]);
  const reply = add("assistant", "");
  let tokens = 0;
  let stats = null;
  let failed = null;
  controller = new AbortController();
  stopped = false;
  busy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({ messages, stream: true, ...asked }),
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
        if (delta && delta.content && mine === conversation) {
          reply.textContent += delta.content;
          tokens += 1;
          follow(reply);
        }
        if (chunk.selfextend) stats = chunk.selfextend;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") failed = e.message;
  } finally {
    controller = null;
    busy(false);
    $("input").focus();
  }
  if (mine !== conversation) return;  // "New chat" was pressed meanwhile: that conversation is gone
  if (reply.textContent) {
    turns.push({ role: "user", content: text }, { role: "assistant", content: reply.textContent });
  } else if (failed !== null || stopped) {
    reply.remove();  // nothing answered: the message is not part of the conversation
    user.classList.add("unsent");
    user.title = "not part of the conversation: the model did not answer it";
  }
  if (failed !== null) {
    add("error", "error: " + failed + (reply.textContent ? " (the reply so far is kept)" : " (not sent)"));
  } else if (stats) {
    note(statsText(stats, tokens));
  } else if (stopped) {
    note(`stopped after ${plural(tokens, "piece")} of text`);
  }
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.replace(/\s+$/, "");  // a first line's indentation is kept
  if (!text.trim() || controller) return;
  const asked = settings();
  if (typeof asked === "string") {
    add("error", asked);
    return;  // the message stays in the box
  }
  $("input").value = "";
  send(text, asked);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  if (!controller) return;
  stopped = true;
  controller.abort();
});
$("clear").addEventListener("click", () => {
  conversation += 1;
  if (controller) controller.abort();
  turns.length = 0;
  $("log").textContent = "";
  $("input").focus();
});

// The model line at the top: the server's model and slots, or that it needs the key.
function showModel() {
  fetch("/v1/models", { headers: headers() })
    .then((r) => {
      if (r.status === 401) throw new Error("this server needs an API key: enter it in the API key field");
      return r.json();
    })
    .then((m) => {
      const d = m.data && m.data[0];
      if (d) $("model").textContent = `${d.id}, ${d.meta.n_parallel} slot${d.meta.n_parallel === 1 ? "" : "s"} of ${d.meta.n_ctx} cells`;
    })
    .catch((e) => {
      $("model").textContent = e.message.startsWith("this server") ? e.message : "";
    });
}
showModel();
