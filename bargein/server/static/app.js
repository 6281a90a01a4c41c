// The chat page: conversations, streaming answers, Stop, and the server's request list.
//
// One owner for each piece of state: `state` below. The DOM is derived from it; only the
// answer being streamed is patched in place, so that a long answer does not re-render
// the whole conversation on every token. The answer is written to storage as it streams
// (throttled, and at once when the page goes away), so a reload loses nothing.

import * as answers from "./answers.js";
import * as api from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";
import { installSchemaBox, responseFormat } from "./structured.js";

const SAVE_EVERY_MS = 300; // storage writes while an answer streams
const PROGRESS_POLL_MS = 250; // /v1/requests polls while the prompt is read
const COLLAPSE_CHARS = 1200; // user messages longer than this (or COLLAPSE_LINES) fold
const COLLAPSE_LINES = 14;

const $ = (sel) => document.querySelector(sel);
const el = {
  messages: $("#messages"), prompt: $("#prompt"), send: $("#send"), stop: $("#stop"),
  regenerate: $("#regenerate"), conversations: $("#conversations"), title: $("#chat-title"),
  error: $("#error"), errorText: $("#error .error-text"), errorRetry: $("#error-retry"),
  model: $("#model"), connection: $("#connection"), requests: $("#requests"), panel: $("#panel"),
  systemPrompt: $("#system-prompt"), temperature: $("#temperature"), topP: $("#top-p"),
  maxTokens: $("#max-tokens"), apiKey: $("#api-key"), rememberKey: $("#remember-key"),
};

const state = {
  settings: store.loadSettings(),
  conversations: store.loadConversations(),
  currentId: store.loadCurrentId(),
  model: null,
  // The one request this page has in flight: { conv, msg, requestId, controller, stopRequested }.
  inflight: null,
  leaving: false, // the page is being unloaded
};

const current = () => state.conversations.find((c) => c.id === state.currentId);
const save = () => { store.saveConversations(state.conversations); store.saveCurrentId(state.currentId); };

// While an answer streams: save at most every SAVE_EVERY_MS.
let saveTimer = null;
function saveSoon() {
  if (saveTimer) return;
  saveTimer = setTimeout(() => { saveTimer = null; save(); }, SAVE_EVERY_MS);
}

// ---- errors ----------------------------------------------------------------------------

function showError(message, { retry = false } = {}) {
  el.errorText.textContent = message;
  el.errorRetry.hidden = !retry;
  el.error.hidden = false;
}
const clearError = () => { el.error.hidden = true; el.error.classList.remove("auth"); };

function reportError(e) {
  if (e.kind === "auth") {
    showError(e.message, { retry: true });
    el.error.classList.add("auth");
    openSettings(el.apiKey);
  } else if (e.kind === "network") {
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

// While the prompt is read: a progress bar from /v1/requests (prompt_computed of
// prompt_tokens), or the typing dots before the server has listed the request.
function pendingHtml(msg) {
  const p = msg.progress;
  if (p?.status === "queued") return '<p class="muted waiting">Waiting for the server (queued)…</p>';
  if (!p || !p.total || p.done >= p.total) {
    return '<span class="typing" aria-label="Processing the prompt"><i></i><i></i><i></i></span>';
  }
  const done = Math.max(0, Math.floor(Number(p.done))), total = Math.max(1, Math.floor(Number(p.total)));
  const pct = Math.min(100, Math.floor((100 * done) / total));
  // The bar's width is set through the DOM (fillMessage): the CSP allows no style attributes.
  return `<div class="prompt-progress" data-testid="prompt-progress" role="progressbar" aria-valuemin="0" aria-valuemax="${total}" aria-valuenow="${done}">` +
    `<div class="bar"><i data-pct="${pct}"></i></div>` +
    `<span class="label">Reading the prompt: ${done.toLocaleString("en")} / ${total.toLocaleString("en")} tokens (${pct}%)</span></div>`;
}

function versionsHtml(msg) {
  const n = answers.versionCount(msg);
  if (n < 2) return "";
  const i = answers.versionIndex(msg);
  const busy = !!state.inflight;
  return `<span class="versions" data-testid="versions"><button type="button" class="icon prev-version" aria-label="Previous version"${i === 0 || busy ? " disabled" : ""}>‹</button>` +
    `<span class="version-label">${escapeHtml(`${i + 1}/${n}`)}</span>` +
    `<button type="button" class="icon next-version" aria-label="Next version"${i === n - 1 || busy ? " disabled" : ""}>›</button></span>`;
}

function isLong(text) {
  return text.length > COLLAPSE_CHARS || text.split("\n").length > COLLAPSE_LINES;
}

function fillMessage(node, msg) {
  const body = node.querySelector(".content");
  if (msg.role === "assistant") {
    body.innerHTML = msg.content ? renderMarkdown(msg.content)
      : msg.pending ? pendingHtml(msg)
      : '<p class="muted">(stopped before the first token)</p>';
    const bar = body.querySelector(".prompt-progress .bar i");
    if (bar) bar.style.width = `${Number(bar.dataset.pct)}%`;
  } else {
    body.textContent = msg.content;
    const long = isLong(msg.content);
    node.classList.toggle("collapsible", long);
    if (long && !node.dataset.expanded) node.classList.add("collapsed");
  }
  node.dataset.finish = msg.finishReason || "";
  node.dataset.stop = msg.stopKind || "";
  node.classList.toggle("pending", !!msg.pending);
  node.classList.toggle("stopped", !!msg.stopped);
  const meta = node.querySelector(".meta");
  const look = answers.STOP_KINDS[msg.stopKind];
  const badge = look ? `<span class="badge stop-badge" data-testid="stop-badge">${escapeHtml(look.badge)}</span>`
    : msg.interrupted ? '<span class="badge warn">interrupted</span>' : "";
  const note = look && !msg.pending ? answers.stopNote(msg) : "";
  const stats = msg.stats ? `<span class="stats">${escapeHtml(formatStats(msg.stats))}</span>` : "";
  const more = msg.role === "user" && isLong(msg.content)
    ? `<button type="button" class="link toggle-more">${node.classList.contains("collapsed") ? "Show more" : "Show less"}</button>` : "";
  const edit = msg.role === "user" && !state.inflight ? '<button type="button" class="link edit">Edit</button>' : "";
  meta.innerHTML = (msg.role === "assistant" ? versionsHtml(msg) : "") + badge + stats + more + edit +
    (note ? `<div class="stop-note" data-testid="stop-note">${escapeHtml(note)}</div>` : "");
}

function messageNode(msg, index) {
  const node = document.createElement("article");
  node.className = "message";
  node.dataset.role = msg.role;
  node.dataset.index = index;
  node.innerHTML = `<div class="who">${msg.role === "user" ? "You" : escapeHtml(msg.model || state.model || "Assistant")}</div>` +
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

// Ask the server for one more answer at the end of `conv` (or a new version of `into`, its
// last answer). The answer is stored at once and kept whatever happens: a stop leaves the
// partial text, marked with how it stopped.
async function generate(conv, into = null) {
  if (state.inflight) return;
  clearError();
  if (!state.model) await loadModel();
  let msg = into;
  if (msg) answers.startVersion(msg);
  else conv.messages.push((msg = { role: "assistant", content: "" }));
  Object.assign(msg, { pending: true, streaming: true, model: state.model || undefined });
  const f = { conv, msg, requestId: api.newRequestId(), controller: new AbortController(), stopRequested: false };
  const body = requestBody(conv, msg);
  conv.updated = Date.now();
  state.inflight = f;
  save(); // the question (and the empty answer) survive a reload from now on
  render();
  watchPrompt(f);
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
    const { finishReason, cancelReason, usage } = await api.streamChat({
      body, requestId: f.requestId, signal: f.controller.signal,
      onDelta: (text) => {
        tLast = performance.now();
        tFirst ??= tLast;
        pieces += 1;
        delete msg.pending;
        msg.content += text;
        patchInflight();
        saveSoon();
      },
    });
    msg.finishReason = finishReason || "incomplete";
    msg.cancelReason = cancelReason || undefined;
    msg.stopKind = answers.stopKind(finishReason, cancelReason) || undefined;
    msg.stopped = finishReason === "cancelled";
    msg.stats = stats(usage, msg.stopKind === "lost" ? "incomplete (connection lost)"
      : msg.finishReason + (cancelReason ? ` (${cancelReason})` : ""));
    if (msg.stopKind === "shutdown") setConnected(false);
  } catch (e) {
    // The page is going away (reload, tab closed): its fetch breaks off. The answer stays
    // stored as streaming; the next page load shows it as stopped (recoverInterrupted).
    if (state.leaving) return;
    if (e.name === "AbortError") { // the fallback of Stop: the stream was cut on this side
      msg.finishReason = "cancelled";
      msg.stopKind = "user";
      msg.stopped = true;
      msg.stats = stats(null, "cancelled (connection closed)");
    } else if (e.kind === "network" && msg.content) { // broke mid-answer: keep what arrived
      msg.finishReason = "incomplete";
      msg.stopKind = "lost";
      msg.stats = stats(null, "incomplete (connection lost)");
      setConnected(false);
    } else {
      msg.finishReason = "error";
      msg.interrupted = true;
      reportError(e);
    }
  } finally {
    if (!state.leaving) settle(f);
  }
}

// The end of a generation, however it ended: store the answer, free the page for the next.
function settle(f) {
  const { conv, msg } = f;
  clearTimeout(f.fallbackTimer);
  clearTimeout(saveTimer);
  saveTimer = null;
  delete msg.pending;
  delete msg.streaming;
  delete msg.progress;
  // An answer that failed before any text is dropped (or its version, when regenerating),
  // so that Retry asks again.
  if (msg.interrupted && !msg.content) dropFailed(conv, msg);
  else answers.storeVersion(msg);
  state.inflight = null;
  save();
  render();
  pollRequests();
}

function dropFailed(conv, msg) {
  if (answers.versionCount(msg) > 1) {
    answers.dropShownVersion(msg);
  } else {
    conv.messages.splice(conv.messages.indexOf(msg), 1);
  }
}

// While the prompt is read (no token yet), ask /v1/requests how far it is, for the
// progress bar. The OpenAI stream is left standard; this is a side channel.
async function watchPrompt(f) {
  while (state.inflight === f && f.msg.pending) {
    try {
      const list = await api.listRequests();
      const r = (list.data || []).find((x) => x.id === f.requestId);
      if (r && f.msg.pending) {
        f.msg.progress = { status: r.status, done: r.prompt_computed ?? 0, total: r.prompt_tokens ?? 0 };
        patchInflight();
      }
    } catch { /* the answer's own stream reports errors */ }
    await new Promise((resolve) => setTimeout(resolve, PROGRESS_POLL_MS));
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

// A new version of the last answer; the earlier ones stay, reachable with ‹ ›.
function regenerate() {
  const conv = current();
  if (!conv || state.inflight || !conv.messages.some((m) => m.role === "user")) return;
  const last = conv.messages.at(-1);
  generate(conv, last.role === "assistant" ? last : null);
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
  // Later turns are not dropped silently: the conversation as it was is kept as a copy.
  const later = conv.messages.length - index - 1;
  if (later > 0) {
    const warn = document.createElement("p");
    warn.className = "edit-warning";
    warn.dataset.testid = "edit-warning";
    warn.textContent = `Sending replaces the ${later} later message${later > 1 ? "s" : ""} here; ` +
      "the conversation as it is now is kept as a copy in the sidebar.";
    body.prepend(warn);
  }
  body.querySelector(".cancel-edit").onclick = () => fillMessage(node, msg);
  body.querySelector(".save-edit").onclick = () => {
    const text = box.value.trim();
    if (!text || state.inflight) return;
    if (later > 0) keepCopy(conv);
    conv.messages = [...conv.messages.slice(0, index), { role: "user", content: text }];
    generate(conv);
  };
}

function keepCopy(conv) {
  const copy = { ...structuredClone(conv), ...store.newConversation(), title: `${conv.title} (before edit)` };
  copy.messages = structuredClone(conv.messages);
  state.conversations.splice(state.conversations.indexOf(conv) + 1, 0, copy);
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
      if (key === "apiKey") {
        api.setApiKey(el[key].value);
        store.saveApiKey(el[key].value, el.rememberKey.checked);
      }
    });
  }
  el.rememberKey.checked = store.loadApiKey().remembered;
  el.rememberKey.addEventListener("change", () => store.saveApiKey(el.apiKey.value, el.rememberKey.checked));
  el.apiKey.addEventListener("change", () => loadModel());
  api.setApiKey(state.settings.apiKey);
}

// The latest loadModel call. A changed key and a Retry each start one; an older call's answer
// that comes back later (a 401 for the key just replaced) is stale and must not show.
let modelLoads = 0;

async function loadModel() {
  const load = ++modelLoads;
  try {
    const models = await api.getModels();
    if (load !== modelLoads) return;
    state.model = models.data?.[0]?.id ?? null;
    el.model.textContent = state.model || "no model";
    setConnected(true);
    if (!state.inflight) renderMessages(); // speaker labels name the model
  } catch (e) {
    if (load !== modelLoads) return;
    el.model.textContent = e.kind !== "auth" ? "unavailable" : state.settings.apiKey ? "API key rejected" : "API key needed";
    if (e.kind === "auth") setConnected(true, "Connected; the server wants an API key");
    reportError(e);
  }
}

function openSettings(focus) {
  document.body.classList.remove("panel-toggled"); // wide screens: the panel shows by default
  if (window.matchMedia("(max-width: 1000px)").matches) document.body.classList.add("panel-toggled");
  focus?.focus();
}

// ---- the requests panel ----------------------------------------------------------------

function setConnected(ok, title = null) {
  el.connection.className = ok ? "connection ok" : "connection lost";
  el.connection.title = title || (ok ? "Connected to the server" : "Lost connection to the server");
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
    const computed = r.prompt_computed ?? r.prompt_tokens;
    const prompt = computed < r.prompt_tokens ? `${computed}/${r.prompt_tokens} read` : `${r.prompt_tokens}`;
    row.querySelector(".req-numbers").textContent =
      `· prompt ${prompt} · generated ${r.completion_tokens} · ${Number(r.age_s).toFixed(1)} s${deadline}`;
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
    else if (e.kind === "auth") renderRequests([], e.message);
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
  const node = e.target.closest(".message");
  if (e.target.closest(".copy-code")) copyCode(e.target.closest(".copy-code"));
  if (e.target.closest(".edit") && !state.inflight) editMessage(node);
  if (e.target.closest(".toggle-more")) {
    node.classList.toggle("collapsed");
    node.dataset.expanded = node.classList.contains("collapsed") ? "" : "1";
    fillMessage(node, current().messages[Number(node.dataset.index)]);
  }
  const step = e.target.closest(".prev-version") ? -1 : e.target.closest(".next-version") ? 1 : 0;
  if (step && !state.inflight) {
    const msg = current().messages[Number(node.dataset.index)];
    answers.showVersion(msg, answers.versionIndex(msg) + step);
    save();
    fillMessage(node, msg);
  }
});
el.errorRetry.addEventListener("click", () => { clearError(); if (!state.model) loadModel(); regenerate(); });
$("#error-close").addEventListener("click", clearError);
$("#toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
$("#toggle-panel").addEventListener("click", () => document.body.classList.toggle("panel-toggled"));
const closeOverlays = () => document.body.classList.remove("show-sidebar", "panel-toggled");
$("#close-panel").addEventListener("click", closeOverlays);
$("#backdrop").addEventListener("click", closeOverlays);
// Leaving the page mid-answer: write the partial answer now, not at the next throttle tick,
// and leave it marked as streaming (the broken-off fetch must not mark it "connection lost").
const leave = () => { state.leaving = true; if (state.inflight) save(); };
window.addEventListener("beforeunload", leave);
window.addEventListener("pagehide", leave);
document.addEventListener("visibilitychange", () => { if (document.hidden && state.inflight) save(); });
window.addEventListener("storage", (e) => { // another tab changed the conversations
  if (e.key === "bargein.conversations" && !state.inflight) { state.conversations = store.loadConversations(); render(); }
});

if (!current()) state.currentId = state.conversations[0]?.id ?? null;
// Answers that were streaming when the page went away are stopped ones now.
if (state.conversations.some((c) => c.messages.map(answers.recoverInterrupted).some(Boolean))) save();
bindSettings();
installSchemaBox();
render();
loadModel();
setInterval(pollRequests, 1000);
el.prompt.focus();
