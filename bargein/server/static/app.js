// The chat page: conversations, streaming answers, Stop, and the server's request list.
//
// One owner for each piece of state: `state` below. The DOM is derived from it; only the
// answer being streamed is patched in place, so that a long answer does not re-render
// the whole conversation on every token.

import * as api from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";
import { installSchemaBox, responseFormat } from "./structured.js";

const $ = (sel) => document.querySelector(sel);
const el = {
  messages: $("#messages"), prompt: $("#prompt"), send: $("#send"), stop: $("#stop"),
  regenerate: $("#regenerate"), conversations: $("#conversations"), title: $("#chat-title"),
  error: $("#error"), errorText: $("#error .error-text"), errorRetry: $("#error-retry"),
  model: $("#model"), connection: $("#connection"), requests: $("#requests"), panel: $("#panel"),
  systemPrompt: $("#system-prompt"), temperature: $("#temperature"), topP: $("#top-p"),
  maxTokens: $("#max-tokens"), apiKey: $("#api-key"),
};

const state = {
  settings: store.loadSettings(),
  conversations: store.loadConversations(),
  currentId: store.loadCurrentId(),
  model: null,
  // The one request this page has in flight: { conv, msg, requestId, controller, stopRequested }.
  inflight: null,
};

const current = () => state.conversations.find((c) => c.id === state.currentId);
const save = () => { store.saveConversations(state.conversations); store.saveCurrentId(state.currentId); };

// ---- errors ----------------------------------------------------------------------------

function showError(message, { retry = false } = {}) {
  el.errorText.textContent = message;
  el.errorRetry.hidden = !retry;
  el.error.hidden = false;
}
const clearError = () => { el.error.hidden = true; };

function reportError(e) {
  if (e.kind === "network") {
    showError(`${e.message} Check that \`bargein serve\` is still running, then press Retry.`, { retry: true });
  } else {
    showError(e.message, { retry: e.kind === "stream" || e.status >= 500 });
  }
}

// ---- rendering -------------------------------------------------------------------------

function formatStats(s) {
  const parts = [];
  if (s.ttftMs != null) parts.push(`TTFT ${s.ttftMs < 1000 ? `${Math.round(s.ttftMs)} ms` : `${(s.ttftMs / 1000).toFixed(2)} s`}`);
  if (s.tokensPerSec != null) parts.push(`${s.tokensPerSec.toFixed(1)} tok/s`);
  if (s.completionTokens != null) parts.push(`${s.completionTokens} tokens`);
  if (s.promptTokens != null) parts.push(`prompt ${s.promptTokens} (cached ${s.cachedTokens ?? 0})`);
  if (s.finishReason) parts.push(`finish: ${s.finishReason}`);
  return parts.join(" · ");
}

function fillMessage(node, msg) {
  const body = node.querySelector(".content");
  if (msg.role === "assistant") {
    body.innerHTML = msg.content ? renderMarkdown(msg.content)
      : msg.pending ? '<span class="typing" aria-label="Processing the prompt"><i></i><i></i><i></i></span>'
      : '<p class="muted">(stopped before the first token)</p>';
  } else {
    body.textContent = msg.content;
  }
  node.dataset.finish = msg.finishReason || "";
  node.classList.toggle("pending", !!msg.pending);
  node.classList.toggle("stopped", !!msg.stopped);
  const meta = node.querySelector(".meta");
  const badge = msg.stopped ? '<span class="badge">stopped</span>' : msg.interrupted ? '<span class="badge warn">interrupted</span>' : "";
  const stats = msg.stats ? `<span class="stats">${escapeHtml(formatStats(msg.stats))}</span>` : "";
  const edit = msg.role === "user" && !state.inflight ? '<button type="button" class="link edit">Edit</button>' : "";
  meta.innerHTML = badge + stats + edit;
}

function messageNode(msg, index) {
  const node = document.createElement("article");
  node.className = "message";
  node.dataset.role = msg.role;
  node.dataset.index = index;
  node.innerHTML = `<div class="who">${msg.role === "user" ? "You" : escapeHtml(state.model || "Assistant")}</div>` +
    '<div class="content"></div><div class="meta"></div>';
  fillMessage(node, msg);
  return node;
}

function renderMessages() {
  const conv = current();
  el.messages.replaceChildren(...(conv?.messages || []).map(messageNode));
  if (!conv?.messages.length) {
    el.messages.innerHTML = '<div class="welcome"><h2>What can I help with?</h2>' +
      "<p>Answers stream as they are generated. Press <b>Stop</b> at any moment: the partial answer stays, " +
      "and the next message continues from the server's cache.</p></div>";
  }
  el.messages.scrollTop = el.messages.scrollHeight;
}

function renderConversations() {
  el.conversations.replaceChildren(...state.conversations.map((c) => {
    const li = document.createElement("li");
    li.className = c.id === state.currentId ? "conversation active" : "conversation";
    li.dataset.id = c.id;
    li.innerHTML = `<button type="button" class="open" title="${escapeHtml(c.title)}">${escapeHtml(c.title)}</button>` +
      '<button type="button" class="icon rename" title="Rename" aria-label="Rename">✎</button>' +
      '<button type="button" class="icon delete" title="Delete" aria-label="Delete">✕</button>';
    return li;
  }));
  el.title.textContent = current()?.title || "New chat";
}

function renderControls() {
  const busy = !!state.inflight;
  el.stop.hidden = !busy;
  el.stop.disabled = busy && state.inflight.stopRequested;
  el.stop.textContent = busy && state.inflight.stopRequested ? "Stopping…" : "■ Stop";
  el.send.hidden = busy;
  const msgs = current()?.messages || [];
  el.regenerate.disabled = busy || !msgs.some((m) => m.role === "user");
}

function render() {
  renderConversations();
  renderMessages();
  renderControls();
}

// Re-render the streaming answer at most once per frame, following it down the page
// unless the reader has scrolled up.
let framePending = false;
function patchInflight() {
  if (framePending) return;
  framePending = true;
  requestAnimationFrame(() => {
    framePending = false;
    const f = state.inflight;
    if (!f || f.conv !== current()) return;
    const node = el.messages.querySelector(`.message[data-index="${f.conv.messages.indexOf(f.msg)}"]`);
    if (!node) return;
    const atBottom = el.messages.scrollHeight - el.messages.scrollTop - el.messages.clientHeight < 80;
    fillMessage(node, f.msg);
    if (atBottom) el.messages.scrollTop = el.messages.scrollHeight;
  });
}

// ---- generation ------------------------------------------------------------------------

function requestBody(conv, msg) {
  const s = state.settings;
  // A stopped answer goes back as it was delivered, even when empty: the server's cache
  // holds exactly that, and chat templates that insist on alternating roles stay happy.
  const messages = conv.messages.filter((m) => m !== msg).map(({ role, content }) => ({ role, content }));
  if (s.systemPrompt.trim()) messages.unshift({ role: "system", content: s.systemPrompt });
  const body = { messages };
  if (state.model) body.model = state.model;
  if (s.temperature !== "" && s.temperature != null) body.temperature = Number(s.temperature);
  if (s.topP !== "" && s.topP != null) body.top_p = Number(s.topP);
  if (s.maxTokens !== "" && s.maxTokens != null) body.max_tokens = Number(s.maxTokens);
  return Object.assign(body, responseFormat());
}

// Ask the server for one more answer at the end of `conv`. The answer is appended at once
// and kept whatever happens: a stop leaves the partial text, marked stopped.
async function generate(conv) {
  if (state.inflight) return;
  clearError();
  if (!state.model) await loadModel();
  const msg = { role: "assistant", content: "", pending: true };
  const f = { conv, msg, requestId: api.newRequestId(), controller: new AbortController(), stopRequested: false };
  const body = requestBody(conv, msg);
  conv.messages.push(msg);
  conv.updated = Date.now();
  state.inflight = f;
  render();
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let pieces = 0;
  const stats = (usage, finishReason) => {
    const n = usage?.completion_tokens ?? pieces;
    return {
      ttftMs: tFirst == null ? null : tFirst - t0,
      tokensPerSec: n > 1 && tLast > tFirst ? ((n - 1) * 1000) / (tLast - tFirst) : null,
      completionTokens: n,
      promptTokens: usage?.prompt_tokens ?? null,
      cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? (usage ? 0 : null),
      finishReason,
    };
  };
  try {
    const { finishReason, usage } = await api.streamChat({
      body, requestId: f.requestId, signal: f.controller.signal,
      onDelta: (text) => {
        tLast = performance.now();
        tFirst ??= tLast;
        pieces += 1;
        msg.content += text;
        patchInflight();
      },
    });
    msg.finishReason = finishReason || "incomplete";
    msg.stopped = finishReason === "cancelled";
    msg.stats = stats(usage, msg.finishReason);
  } catch (e) {
    if (e.name === "AbortError") { // the fallback of Stop: the stream was cut on this side
      msg.finishReason = "cancelled";
      msg.stopped = true;
      msg.stats = stats(null, "cancelled (connection closed)");
    } else {
      msg.finishReason = "error";
      msg.interrupted = true;
      reportError(e);
    }
  } finally {
    clearTimeout(f.fallbackTimer);
    delete msg.pending;
    // An answer that failed before any text is dropped, so that Retry asks again.
    if (msg.interrupted && !msg.content) conv.messages.splice(conv.messages.indexOf(msg), 1);
    state.inflight = null;
    save();
    render();
    pollRequests();
  }
}

// Stop: ask the server to cancel our request and let the stream end by itself (it ends with
// finish_reason "cancelled" and the usage). If the server cannot be asked, or the stream
// does not end soon after, cut the connection instead.
async function stop() {
  const f = state.inflight;
  if (!f || f.stopRequested) return;
  f.stopRequested = true;
  renderControls();
  try {
    await api.cancelRequest(f.requestId);
    f.fallbackTimer = setTimeout(() => f.controller.abort(), 10000);
  } catch {
    f.controller.abort();
  }
}

function send() {
  const text = el.prompt.value.trim();
  if (!text || state.inflight) return;
  let conv = current();
  if (!conv) {
    conv = store.newConversation();
    state.conversations.unshift(conv);
    state.currentId = conv.id;
  }
  if (!conv.messages.length && conv.title === "New chat") conv.title = store.titleFrom(text);
  conv.messages.push({ role: "user", content: text });
  el.prompt.value = "";
  autosize();
  generate(conv);
}

function regenerate() {
  const conv = current();
  if (!conv || state.inflight) return;
  while (conv.messages.length && conv.messages.at(-1).role === "assistant") conv.messages.pop();
  if (conv.messages.length) generate(conv);
  else render();
}

function editMessage(node) {
  const conv = current();
  const index = Number(node.dataset.index);
  const msg = conv.messages[index];
  const body = node.querySelector(".content");
  body.innerHTML = '<textarea class="edit-box"></textarea><div class="edit-actions">' +
    '<button type="button" class="primary save-edit">Save &amp; send</button> <button type="button" class="cancel-edit">Cancel</button></div>';
  const box = body.querySelector("textarea");
  box.value = msg.content;
  box.focus();
  body.querySelector(".cancel-edit").onclick = () => fillMessage(node, msg);
  body.querySelector(".save-edit").onclick = () => {
    const text = box.value.trim();
    if (!text || state.inflight) return;
    conv.messages = [...conv.messages.slice(0, index), { role: "user", content: text }];
    generate(conv);
  };
}

// ---- conversations ---------------------------------------------------------------------

function newChat() {
  const conv = current();
  if (conv && !conv.messages.length) { el.prompt.focus(); return; } // reuse an empty one
  const fresh = store.newConversation();
  state.conversations.unshift(fresh);
  state.currentId = fresh.id;
  save();
  render();
  el.prompt.focus();
  document.body.classList.remove("show-sidebar");
}

function onConversationClick(event) {
  const li = event.target.closest(".conversation");
  if (!li) return;
  const conv = state.conversations.find((c) => c.id === li.dataset.id);
  if (event.target.closest(".delete")) {
    const button = event.target.closest(".delete");
    if (!button.classList.contains("confirm")) { // a second click confirms
      button.classList.add("confirm");
      button.textContent = "Delete?";
      return;
    }
    if (state.inflight?.conv === conv) stop();
    state.conversations = state.conversations.filter((c) => c !== conv);
    if (state.currentId === conv.id) state.currentId = state.conversations[0]?.id ?? null;
  } else if (event.target.closest(".rename")) {
    const input = document.createElement("input");
    input.className = "rename-box";
    input.value = conv.title;
    li.querySelector(".open").replaceWith(input);
    input.focus();
    input.select();
    const done = (keep) => { if (keep && input.value.trim()) conv.title = input.value.trim(); save(); renderConversations(); };
    input.onkeydown = (e) => { if (e.key === "Enter") done(true); if (e.key === "Escape") done(false); };
    input.onblur = () => done(true);
    return;
  } else {
    state.currentId = conv.id;
    document.body.classList.remove("show-sidebar");
  }
  save();
  render();
}

// ---- settings and model ----------------------------------------------------------------

// Each setting has an input of the same name in `el`; values are kept as typed and
// converted when a request is built, so that an invalid one reaches the server's check.
function bindSettings() {
  for (const key of Object.keys(store.DEFAULT_SETTINGS)) {
    el[key].value = state.settings[key] ?? "";
    el[key].addEventListener("input", () => {
      state.settings[key] = el[key].value;
      store.saveSettings(state.settings);
      if (key === "apiKey") api.setApiKey(el[key].value);
    });
  }
  el.apiKey.addEventListener("change", () => loadModel());
  api.setApiKey(state.settings.apiKey);
}

async function loadModel() {
  try {
    const models = await api.getModels();
    state.model = models.data?.[0]?.id ?? null;
    el.model.textContent = state.model || "no model";
    setConnected(true);
  } catch (e) {
    el.model.textContent = "unavailable";
    reportError(e);
  }
}

// ---- the requests panel ----------------------------------------------------------------

function setConnected(ok) {
  el.connection.className = ok ? "connection ok" : "connection lost";
  el.connection.title = ok ? "Connected to the server" : "Lost connection to the server";
}

function requestRow(r) {
  const row = document.createElement("div");
  row.className = "request-row";
  row.dataset.id = r.id;
  row.innerHTML = '<code class="req-id"></code><button type="button" class="cancel">Cancel</button>' +
    '<div class="req-meta"><span class="req-status"></span> <span class="req-numbers"></span></div>';
  const id = row.querySelector(".req-id");
  id.textContent = r.id.length > 26 ? `${r.id.slice(0, 17)}…${r.id.slice(-6)}` : r.id;
  id.title = r.id;
  return row;
}

// Rows are updated in place, so that a Cancel button is never swapped out under the pointer.
function renderRequests(list, emptyText = "Nothing running.") {
  const seen = new Set(list.map((r) => r.id));
  for (const row of el.requests.querySelectorAll(".request-row")) if (!seen.has(row.dataset.id)) row.remove();
  for (const r of list) {
    let row = [...el.requests.querySelectorAll(".request-row")].find((x) => x.dataset.id === r.id);
    if (!row) el.requests.append((row = requestRow(r)));
    row.classList.toggle("mine", r.id === state.inflight?.requestId);
    row.querySelector(".req-status").textContent = r.status + (r.id === state.inflight?.requestId ? " (this chat)" : "");
    row.querySelector(".req-status").dataset.status = r.status;
    const deadline = r.deadline_s == null ? "" : ` · deadline ${Number(r.deadline_s).toFixed(1)} s`;
    row.querySelector(".req-numbers").textContent =
      `· prompt ${r.prompt_tokens} · generated ${r.completion_tokens} · ${Number(r.age_s).toFixed(1)} s${deadline}`;
  }
  const empty = el.requests.querySelector(".empty");
  empty.textContent = emptyText;
  empty.hidden = list.length > 0;
}

async function pollRequests() {
  if (document.hidden || !el.panel.offsetParent) return;
  try {
    const list = await api.listRequests();
    renderRequests(list.data || []);
    setConnected(true);
  } catch (e) {
    setConnected(e.kind !== "network");
    if (e.kind === "network") renderRequests([], "The server cannot be reached.");
  }
}

async function onRequestsClick(event) {
  const button = event.target.closest(".cancel");
  if (!button) return;
  const id = button.closest(".request-row").dataset.id;
  button.disabled = true;
  button.textContent = "Cancelling…";
  if (id === state.inflight?.requestId) return stop();
  try {
    await api.cancelRequest(id);
  } catch (e) {
    if (e.status !== 404) reportError(e); // 404: it finished meanwhile
  }
  pollRequests();
}

// ---- wiring ----------------------------------------------------------------------------

function autosize() {
  el.prompt.style.height = "auto";
  el.prompt.style.height = `${Math.min(el.prompt.scrollHeight, 240)}px`;
}

async function copyCode(button) {
  const text = button.closest(".code-block").querySelector("code").textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch { // no clipboard API outside secure contexts
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

$("#composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
el.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
el.prompt.addEventListener("input", autosize);
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.inflight) stop(); });
el.stop.addEventListener("click", stop);
el.regenerate.addEventListener("click", regenerate);
$("#new-chat").addEventListener("click", newChat);
el.conversations.addEventListener("click", onConversationClick);
el.requests.addEventListener("click", onRequestsClick);
el.messages.addEventListener("click", (e) => {
  if (e.target.closest(".copy-code")) copyCode(e.target.closest(".copy-code"));
  if (e.target.closest(".edit") && !state.inflight) editMessage(e.target.closest(".message"));
});
el.errorRetry.addEventListener("click", () => { clearError(); if (!state.model) loadModel(); regenerate(); });
$("#error-close").addEventListener("click", clearError);
$("#toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
$("#toggle-panel").addEventListener("click", () => document.body.classList.toggle("panel-toggled"));
const closeOverlays = () => document.body.classList.remove("show-sidebar", "panel-toggled");
$("#close-panel").addEventListener("click", closeOverlays);
$("#backdrop").addEventListener("click", closeOverlays);
window.addEventListener("storage", (e) => { // another tab changed the conversations
  if (e.key === "bargein.conversations" && !state.inflight) { state.conversations = store.loadConversations(); render(); }
});

if (!current()) state.currentId = state.conversations[0]?.id ?? null;
bindSettings();
installSchemaBox();
render();
loadModel();
setInterval(pollRequests, 1000);
el.prompt.focus();
