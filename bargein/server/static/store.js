// Conversations and settings, kept in the browser's localStorage; the API key in
// sessionStorage (gone when the tab closes) unless the user asks to remember it.
//
// A conversation is { id, title, messages, updated }; a message is { role, content } plus,
// for answers, the fields answers.js describes (how it ended, stats, versions). Only role
// and content go to the server. The page writes an answer here while it streams, too.

const KEYS = { conversations: "bargein.conversations", current: "bargein.current", settings: "bargein.settings",
  apiKey: "bargein.apiKey" };

export const DEFAULT_SETTINGS = { systemPrompt: "", temperature: 0.7, topP: 0.95, maxTokens: 512, apiKey: "" };

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch { /* storage full or disabled: the page keeps working for this visit */ }
}

// The settings, with the API key from loadApiKey. A key an older page kept in the settings
// moves to this tab's session.
export function loadSettings() {
  const stored = read(KEYS.settings, {});
  if (stored && typeof stored.apiKey === "string" && stored.apiKey) {
    saveApiKey(stored.apiKey, false);
    delete stored.apiKey;
    write(KEYS.settings, stored);
  }
  return { ...DEFAULT_SETTINGS, ...stored, apiKey: loadApiKey().key };
}

export function saveSettings(settings) {
  const { apiKey, ...rest } = settings; // the key is stored by saveApiKey only
  write(KEYS.settings, rest);
}

// { key, remembered }: the key this tab holds, else the one remembered on this device.
export function loadApiKey() {
  try {
    const session = sessionStorage.getItem(KEYS.apiKey);
    if (session) return { key: session, remembered: false };
    const kept = localStorage.getItem(KEYS.apiKey);
    return { key: kept || "", remembered: !!kept };
  } catch {
    return { key: "", remembered: false };
  }
}

// Keeps the key for this tab only, or (remember) in localStorage for every visit.
export function saveApiKey(key, remember) {
  try {
    const [keep, drop] = remember ? [localStorage, sessionStorage] : [sessionStorage, localStorage];
    drop.removeItem(KEYS.apiKey);
    if (key) keep.setItem(KEYS.apiKey, key);
    else keep.removeItem(KEYS.apiKey);
  } catch { /* storage disabled: the key lasts as long as the page */ }
}

export function newConversation() {
  const id = `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 7)}`;
  return { id, title: "New chat", messages: [], updated: Date.now() };
}

export function loadConversations() {
  const list = read(KEYS.conversations, []);
  return Array.isArray(list) ? list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
}

export function saveConversations(list) {
  write(KEYS.conversations, list);
}

export function loadCurrentId() {
  return read(KEYS.current, null);
}

export function saveCurrentId(id) {
  write(KEYS.current, id);
}

// A title from the first user message, until the user renames the conversation.
export function titleFrom(text) {
  const line = text.trim().split("\n")[0].replace(/\s+/g, " ");
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}
