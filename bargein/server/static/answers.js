// How an answer ended, in words a user reads, and the versions of an answer (regenerate).
//
// An answer message is { role: "assistant", content, finishReason, cancelReason, stopKind,
// stats, model } plus, while it streams, { pending, streaming }. `streaming` is written to
// storage with the partial text, so a page that is reloaded or closed mid-answer finds the
// turn again and shows it as stopped (the server cancelled it when the connection went).

// Each way an answer can end early has its own look (data-stop on the message) and words.
export const STOP_KINDS = {
  user: { badge: "Stopped by you", note: "" },
  closed: { badge: "Stopped: page closed", note: "The page was reloaded or closed while this answer streamed; the server stopped it. Send a message to continue." },
  deadline: { badge: "Deadline reached", note: "The server stopped this answer at its time limit per request (bargein serve --request-timeout)." },
  shutdown: { badge: "Server shut down", note: "The server stopped while answering. Start it again, then send a message or press Regenerate." },
  length: { badge: "Token limit", note: "" }, // the note names the limit (stopNote)
  lost: { badge: "Connection lost", note: "The connection to the server broke mid-answer; the text above is what arrived." },
};

// The stop kind of an answer that ended with `finishReason` (null: the stream broke off)
// and the server's `cancelReason`; null for an answer that ended normally.
export function stopKind(finishReason, cancelReason) {
  if (finishReason === "length") return "length";
  if (finishReason == null || finishReason === "incomplete") return "lost";
  if (finishReason !== "cancelled") return null;
  if (cancelReason === "deadline" || cancelReason === "shutdown") return cancelReason;
  if (cancelReason === "disconnect") return "closed";
  return "user";
}

export function stopNote(msg) {
  if (msg.stopKind === "length") {
    const n = msg.stats?.completionTokens;
    return `Cut at the token limit${n ? ` (${n} tokens)` : ""}. Raise Max tokens in Settings for longer answers, or send "continue".`;
  }
  return STOP_KINDS[msg.stopKind]?.note || "";
}

// A message that was still streaming when the page went away: the server has cancelled it
// (a dropped connection cancels), so it is kept as a stopped, continuable answer.
export function recoverInterrupted(msg) {
  if (msg.role !== "assistant" || !(msg.streaming || msg.pending)) return false;
  delete msg.streaming;
  delete msg.pending;
  delete msg.progress;
  msg.finishReason = "cancelled";
  msg.cancelReason = "disconnect";
  msg.stopKind = "closed";
  msg.stopped = true;
  return true;
}

// ---- versions ----------------------------------------------------------------------------
// msg.versions holds a snapshot of every version of the answer; msg.versionIndex says which
// one msg's own fields show. Only the shown version goes back to the server as history.

const VERSION_FIELDS = ["content", "finishReason", "cancelReason", "stopKind", "stopped", "interrupted", "stats", "model"];

function snapshot(msg) {
  return Object.fromEntries(VERSION_FIELDS.filter((k) => msg[k] !== undefined).map((k) => [k, msg[k]]));
}

function load(msg, version) {
  for (const k of VERSION_FIELDS) delete msg[k];
  Object.assign(msg, structuredClone(version));
}

// Both come from storage, which anything on this origin (or a user's tampering) may have
// written: only an array's length and an integer index in range are believed.
export const versionCount = (msg) => (Array.isArray(msg.versions) && msg.versions.length) || 1;
export function versionIndex(msg) {
  const i = msg.versionIndex;
  return Number.isInteger(i) && i >= 0 && i < versionCount(msg) ? i : 0;
}

// Keep the shown version in msg.versions (after it finished or changed).
export function storeVersion(msg) {
  if (!msg.versions) return;
  msg.versions[versionIndex(msg)] = snapshot(msg);
}

// Start a new, empty version at the end; the old ones stay reachable with ‹ ›.
export function startVersion(msg) {
  msg.versions ??= [snapshot(msg)];
  storeVersion(msg);
  msg.versions.push({ content: "" });
  msg.versionIndex = msg.versions.length - 1;
  load(msg, msg.versions[msg.versionIndex]);
}

export function showVersion(msg, index) {
  if (!msg.versions || index < 0 || index >= msg.versions.length) return;
  storeVersion(msg);
  msg.versionIndex = index;
  load(msg, msg.versions[index]);
}

// Drop the shown version (a regenerate that failed before any text) and show the last one left.
export function dropShownVersion(msg) {
  msg.versions.splice(versionIndex(msg), 1);
  msg.versionIndex = msg.versions.length - 1;
  load(msg, msg.versions[msg.versionIndex]);
}
