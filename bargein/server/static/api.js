// The server's HTTP API as the page uses it: auth headers, OpenAI-shaped errors, and
// server-sent events read from a fetch body (EventSource cannot POST).

export class ApiError extends Error {
  // kind: "http" (the server answered with an error), "auth" (401: a key is missing or
  // wrong), "stream" (an error event inside a stream) or "network" (no answer at all: the
  // server is down or unreachable, or the connection broke).
  constructor(message, { kind = "http", status = 0, code = null } = {}) {
    super(message);
    this.kind = kind;
    this.status = status;
    this.code = code;
  }
}

let apiKey = "";
export function setApiKey(key) { apiKey = (key || "").trim(); }

function headers(extra = {}) {
  const h = { "Content-Type": "application/json", ...extra };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText || "error"}`;
  let code = null;
  try {
    const body = await response.json();
    if (body?.error?.message) ({ message, code } = body.error);
    else if (typeof body?.detail === "string") message = body.detail;
    else if (Array.isArray(body?.detail)) message = body.detail.map((d) => d.msg).join("; ");
  } catch { /* not JSON: keep the status line */ }
  if (response.status === 401) {
    message = apiKey ? "The server rejected the API key set in Settings." : "This server needs an API key: enter it in Settings.";
    return new ApiError(message, { kind: "auth", status: 401, code });
  }
  return new ApiError(message, { status: response.status, code });
}

async function call(method, path, body, signal) {
  let response;
  try {
    response = await fetch(path, { method, headers: headers(), body: body && JSON.stringify(body), signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError("Lost connection to the server.", { kind: "network" });
  }
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

export const getModels = () => call("GET", "v1/models");
export const listRequests = () => call("GET", "v1/requests");
export const cancelRequest = (id) => call("POST", `v1/requests/${encodeURIComponent(id)}/cancel`);

// A request id the page chooses, so that Stop can name the request before the server has
// answered at all. crypto.randomUUID exists only in secure contexts (https, localhost).
export function newRequestId() {
  if (crypto.randomUUID) return `chatcmpl-web-${crypto.randomUUID()}`;
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `chatcmpl-web-${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

// Each `data:` payload of an event stream, parsed as JSON; "[DONE]" ends the iteration.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      let event;
      try { event = JSON.parse(data); } catch {
        throw new ApiError("The server sent an event the page cannot read.", { kind: "stream" });
      }
      yield event;
    }
  }
}

// Stream one chat completion. Calls onDelta(text) per content piece, then resolves with
// { finishReason, cancelReason, usage }: finishReason is null when the stream ended without
// one (the connection broke), cancelReason is the server's cancel_reason extension (user,
// disconnect, deadline, shutdown) on a cancelled answer, usage is null when none came.
// An AbortError from `signal` propagates; every other failure is an ApiError.
export async function streamChat({ body, requestId, signal, onDelta }) {
  let response;
  try {
    response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers({ "X-Request-Id": requestId }), signal,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError("Lost connection to the server.", { kind: "network" });
  }
  if (!response.ok) throw await errorFrom(response);
  let finishReason = null;
  let cancelReason = null;
  let usage = null;
  try {
    for await (const event of events(response.body)) {
      if (event.error) throw new ApiError(event.error.message || "The server reported an error.", { kind: "stream", code: event.error.code });
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        if (choice.delta?.content) onDelta(choice.delta.content);
        if (choice.finish_reason) finishReason = choice.finish_reason;
        if (choice.cancel_reason) cancelReason = choice.cancel_reason;
      }
    }
  } catch (e) {
    if (e instanceof ApiError || e.name === "AbortError") throw e;
    throw new ApiError("Lost connection to the server while the answer streamed.", { kind: "network" });
  }
  return { finishReason, cancelReason, usage };
}
