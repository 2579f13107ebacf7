// flashdraft web chat: streams replies from /v1/chat/completions. While a long prompt runs, how much of it is
// done (the request asks for return_progress); while a reply streams, the speed so far (each chunk's `timings`:
// the request asks for timings_per_token); under each finished reply, the speed, tau and acceptance from the
// final chunk's `timings` and `speculative_decoding` objects.
"use strict";

const $ = (id) => document.getElementById(id);
const transcript = $("transcript"), promptBox = $("prompt"), sendButton = $("send"), stopButton = $("stop");
const statusBadge = $("status");
const history = [];
let controller = null;

$("api-key").value = localStorage.getItem("flashdraft-api-key") || "";
$("api-key").addEventListener("change", (e) => localStorage.setItem("flashdraft-api-key", e.target.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, kind) {
  statusBadge.textContent = text;
  statusBadge.className = "status " + kind;
}

async function waitUntilReady() {
  for (;;) {
    try {
      const r = await fetch("/health");
      if (r.ok) break;
    } catch (e) { /* the server is starting: try again */ }
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  try {
    const models = await (await fetch("/v1/models", { headers: headers() })).json();
    const m = models.data[0];
    $("model").textContent = m.id + (m.meta && m.meta.max_draft ? " · DFlash, drafts up to " + m.meta.max_draft
                                                                  : " · plain decoding");
  } catch (e) { /* the model name is decoration only */ }
  setStatus("ready", "ready");
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  div.appendChild(body);
  transcript.appendChild(div);
  transcript.scrollTop = transcript.scrollHeight;
  return div;
}

// What each figure means, shown on hover.
const MEANING = {
  speed: "generated tokens per second of decoding (the prompt's processing not included)",
  tau: "tau: tokens committed per decoding step, the drafter's accepted tokens plus the target's own one; " +
       "1.00 = no gain over plain decoding",
  accepted: "drafted tokens the target confirmed, out of all tokens drafted (steps that drafted nothing " +
            "do not count, so a high rate with tau near 1 means few drafts)",
  steps: "decoding steps, and how many of them verified a draft",
};

function figure(html, meaning) {
  return `<span title="${meaning}">${html}</span>`;
}

function formatStats(timings, spec) {
  const parts = [figure(`<b>${timings.predicted_per_second.toFixed(1)}</b> tok/s`, MEANING.speed)];
  if (timings.draft_n) {
    parts.push(figure(`tau <b>${spec.mean_acceptance_length.toFixed(2)}</b> tokens/step`, MEANING.tau));
    const pct = (100 * timings.draft_n_accepted / timings.draft_n).toFixed(1);
    parts.push(figure(`accepted <b>${timings.draft_n_accepted}/${timings.draft_n}</b> drafted tokens (${pct}%)`,
                      MEANING.accepted));
    const steps = spec.num_spec_steps, plain = (spec.draft_lengths || {})["0"] || 0;
    parts.push(figure(`${steps} steps, ${steps - plain} with a draft`, MEANING.steps));
  } else {
    parts.push("no drafting");
  }
  parts.push(`${timings.predicted_n} tokens`, `prompt ${timings.prompt_n} tokens in ${timings.prompt_ms.toFixed(0)} ms`);
  return parts.join(" · ");
}

function showLive(reply, timings) {
  // The first chunk comes right after the prompt: no speed to show before a second one.
  if (timings.predicted_n < 2 || !(timings.predicted_ms > 0)) return;
  let live = reply.querySelector(".live-stats");
  if (!live) {
    live = Object.assign(document.createElement("div"), { className: "live-stats" });
    reply.appendChild(live);
  }
  live.innerHTML = figure(`<b>${timings.predicted_per_second.toFixed(1)}</b> tok/s`, MEANING.speed) +
                   ` · ${timings.predicted_n} tokens so far`;
}

function showPrompt(reply, progress) {
  // While a long prompt runs pass by pass (the request asks for return_progress): how much of it is done.
  let live = reply.querySelector(".live-stats");
  if (progress.processed >= progress.total) {
    if (live) live.remove();
    return;
  }
  if (!live) {
    live = Object.assign(document.createElement("div"), { className: "live-stats" });
    reply.appendChild(live);
  }
  live.textContent = `prompt ${progress.processed} / ${progress.total} tokens`;
}

function showError(div, message) {
  div.classList.add("error");
  div.querySelector(".body").textContent = message;
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const body = reply.querySelector(".body");
  const request = { messages: history, stream: true, stream_options: { include_usage: true },
                    timings_per_token: true, return_progress: true, max_tokens: parseInt($("max-tokens").value, 10) || 256 };
  const temperature = $("temperature").value;
  if (temperature !== "") request.temperature = parseFloat(temperature);
  controller = new AbortController();
  sendButton.disabled = true;
  stopButton.disabled = false;
  let content = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(request),
                                                    signal: controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      throw new Error(`${r.status}: ${err.error.message}`);
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
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.prompt_progress) {
          showPrompt(reply, chunk.prompt_progress);
          continue;
        }
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
        if (delta) {
          content += delta;
          body.textContent = content;
          transcript.scrollTop = transcript.scrollHeight;
        }
        if (chunk.timings && !chunk.speculative_decoding) {
          showLive(reply, chunk.timings);
        } else if (chunk.timings) {
          reply.querySelectorAll(".live-stats").forEach((e) => e.remove());
          const stats = document.createElement("div");
          stats.className = "stats";
          stats.innerHTML = formatStats(chunk.timings, chunk.speculative_decoding || {});
          reply.appendChild(stats);
        }
      }
    }
    history.push({ role: "assistant", content });
  } catch (e) {
    reply.querySelectorAll(".live-stats").forEach((el) => el.remove());
    if (e.name === "AbortError") {
      history.push({ role: "assistant", content });
      reply.appendChild(Object.assign(document.createElement("div"), { className: "stats", textContent: "stopped" }));
    } else {
      history.pop();
      showError(reply, e.message);
    }
  } finally {
    controller = null;
    sendButton.disabled = false;
    stopButton.disabled = true;
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = promptBox.value.trim();
  if (!text || controller) return;
  promptBox.value = "";
  send(text);
});
promptBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
stopButton.addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  history.length = 0;
  transcript.querySelectorAll(".message").forEach((m) => m.remove());
});

waitUntilReady();
