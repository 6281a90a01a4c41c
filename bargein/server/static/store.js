// Conversations and settings, kept in the browser's localStorage.
//
// A conversation is { id, title, messages, updated }; a message is { role, content } plus,
// for answers, the fields answers.js describes (how it ended, stats, versions). Only role
// and content go to the server. The page writes an answer here while it streams, too.

const KEYS = { conversations: "bargein.conversations", current: "bargein.current", settings: "bargein.settings" };

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

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) };
}

export function saveSettings(settings) {
  write(KEYS.settings, settings);
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
