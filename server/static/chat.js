// The chat page: conversation (kept in localStorage), parameters, model picker, streaming with
// live speed, Stop, and the API key (sessionStorage only). Model text is rendered by markdown.js.
import { HttpError, listModels, streamChat } from "/static/api.js";
import { renderMarkdown } from "/static/markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "slipstream.chat";
const KEY = "slipstream.apiKey";
const THEME = "slipstream.theme";

let state = load();
let controller = null; // the running request's AbortController
let pending = null;    // what to retry once an API key is entered

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "null");
    if (saved && Array.isArray(saved.messages)) return saved;
  } catch (err) {
    // a corrupt entry: start over rather than fail to load the page
  }
  return { messages: [], system: "", params: {} };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function stats(message) {
  const s = message.stats;
  if (!s) return "";
  const parts = [];
  if (s.ttft !== undefined) parts.push(`TTFT ${(s.ttft * 1000).toFixed(0)} ms`);
  if (s.tps !== undefined) parts.push(`${s.tps.toFixed(1)} tokens/s`);
  if (s.tokens !== undefined) parts.push(`${s.tokens} tokens`);
  if (s.note) parts.push(s.note);
  return parts.join(" · ");
}

function messageNode(message) {
  const li = document.createElement("li");
  li.className = `msg ${message.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : "Assistant";
  if (message.thinking) {  // a reasoning model's thinking, folded away above its answer
    const details = document.createElement("details");
    details.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = message.content ? "Thought" : "Thinking…";
    const text = document.createElement("div");
    text.textContent = message.thinking;
    details.append(summary, text);
    details.open = !!message.showThinking;  // kept open across the re-renders of a streaming reply
    details.addEventListener("toggle", () => { message.showThinking = details.open; });
    li.append(details);
  }
  const body = document.createElement("div");
  body.className = "content";
  if (message.role === "assistant") body.append(renderMarkdown(message.content));
  else body.textContent = message.content;
  const meta = document.createElement("div");
  meta.className = "stats";
  meta.textContent = stats(message);
  li.prepend(who);
  li.append(body, meta);
  return li;
}

function render() {
  $("messages").replaceChildren(...state.messages.map(messageNode));
  $("regenerate").disabled = !!controller || !state.messages.some((m) => m.role === "user");
}

function update(index) {
  const node = $("messages").children[index];
  const fresh = messageNode(state.messages[index]);
  if (node) node.replaceWith(fresh); else $("messages").append(fresh);
  fresh.scrollIntoView({ block: "end" });
}

function showStatus(text) {
  $("status").hidden = !text;
  $("status").textContent = text || "";
}

function describe(err) {
  if (err instanceof HttpError) {
    let text = `The server answered ${err.status}: ${err.message}`;
    if (err.retryAfter) text += ` Retry after ${err.retryAfter} s.`;
    return text;
  }
  return `Request failed: ${err.message}`;
}

function params() {
  const body = { temperature: Number($("temperature").value), top_p: Number($("top-p").value),
                 max_tokens: Number($("max-tokens").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("json-mode").checked) body.response_format = { type: "json_object" };
  if ($("model").value) body.model = $("model").value;
  return body;
}

// A 401 for the key `used`. When another key was entered while that request was out, the answer is
// stale: the retry (if any) goes again with the new key, and the form stays closed.
function askForKey(retry, used) {
  if (sessionStorage.getItem(KEY) !== used) {
    if (retry) setTimeout(retry); // after the failed request's own clean-up
    return;
  }
  if (retry) pending = retry; // the models list's own 401 must not drop a message waiting to be sent
  sessionStorage.removeItem(KEY);
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function generate() {
  const history = state.messages.map(({ role, content }) => ({ role, content }));
  if (state.system.trim()) history.unshift({ role: "system", content: state.system });
  const reply = { role: "assistant", content: "", stats: {} };
  state.messages.push(reply);
  const index = state.messages.length - 1;
  update(index);
  controller = new AbortController();
  setBusy(true);
  showStatus("");
  const started = performance.now();
  let first = null;
  let pieces = 0;
  const piece = (add) => {  // a streamed piece of the answer or of the thinking: both count as output
    const now = performance.now();
    if (first === null) first = now;
    pieces += 1;
    add();
    reply.stats.ttft = (first - started) / 1000;
    reply.stats.tokens = pieces;
    if (now > first) reply.stats.tps = (pieces - 1) / ((now - first) / 1000);
    update(index);
  };
  const apiKey = sessionStorage.getItem(KEY);
  try {
    await streamChat({ ...params(), messages: history }, {
      apiKey, signal: controller.signal,
      onDelta: (text) => piece(() => { reply.content += text; }),
      onThinking: (text) => piece(() => { reply.thinking = (reply.thinking || "") + text; }),
      onUsage: (usage) => {
        // the server's own count: a streamed piece may hold more than one token
        reply.stats.tokens = usage.completion_tokens;
        const seconds = (performance.now() - first) / 1000;
        if (first !== null && seconds > 0) reply.stats.tps = (usage.completion_tokens - 1) / seconds;
      },
    });
  } catch (err) {
    if (err.name === "AbortError") {
      reply.stats.note = "stopped";
    } else {
      state.messages.pop();
      if (err instanceof HttpError && err.status === 401) askForKey(generate, apiKey);
      else showStatus(describe(err));
    }
  } finally {
    controller = null;
    setBusy(false);
    save();
    render();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy;
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  save();
  update(state.messages.length - 1);
  generate();
}

function regenerate() {
  if (controller) return;
  while (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
    state.messages.pop();
  }
  if (!state.messages.length) return;
  render();
  generate();
}

async function loadModels() {
  const apiKey = sessionStorage.getItem(KEY);
  try {
    const ids = await listModels(apiKey);
    $("model").replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(state.params.model)) $("model").value = state.params.model;
  } catch (err) {
    if (err instanceof HttpError && err.status === 401) askForKey(null, apiKey);
    else showStatus(describe(err));
  }
}

function isDark() {
  const chosen = localStorage.getItem(THEME);
  return chosen ? chosen === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
}

function applyTheme() {
  const chosen = localStorage.getItem(THEME);
  if (chosen) document.documentElement.dataset.theme = chosen;
  $("theme").textContent = isDark() ? "Light" : "Dark"; // what a click switches to
}

function bindParams() {
  const fields = { temperature: "temperature", "top-p": "top_p", "max-tokens": "max_tokens", seed: "seed" };
  for (const [id, name] of Object.entries(fields)) {
    if (state.params[name] !== undefined) $(id).value = state.params[name];
    $(id).addEventListener("change", () => { state.params[name] = $(id).value; save(); });
  }
  $("json-mode").checked = !!state.params.json;
  $("json-mode").addEventListener("change", () => { state.params.json = $("json-mode").checked; save(); });
  $("model").addEventListener("change", () => { state.params.model = $("model").value; save(); });
  $("system").value = state.system;
  $("system").addEventListener("input", () => { state.system = $("system").value; save(); });
}

function init() {
  bindParams();
  applyTheme();
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && controller) controller.abort();
  });
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    state.messages = [];
    save();
    render();
    showStatus("");
    $("prompt").focus();
  });
  $("theme").addEventListener("click", () => {
    localStorage.setItem(THEME, isDark() ? "light" : "dark");
    applyTheme();
  });
  $("toggle-settings").addEventListener("click", () => {
    const open = document.body.classList.toggle("settings-open");
    $("toggle-settings").setAttribute("aria-expanded", String(open));
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value);
    $("api-key").value = "";
    $("key-form").hidden = true;
    loadModels();
    const retry = pending;
    pending = null;
    if (retry) retry();
  });
  render();
  loadModels();
  $("prompt").focus();
}

init();
