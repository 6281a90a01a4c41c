// The "JSON schema" box in the settings: when it holds a schema, answers are constrained
// to it (response_format json_schema). Self-contained: it adds its own field after the
// max-tokens row and keeps its text in localStorage; app.js asks it for the body field.

const KEY = "bargein.jsonSchema";

export function installSchemaBox() {
  const row = document.querySelector("#max-tokens")?.closest(".row3");
  if (!row || document.querySelector("#json-schema")) return;
  const label = document.createElement("label");
  label.htmlFor = "json-schema";
  label.textContent = "JSON schema (answers must match it; empty: free text)";
  const box = document.createElement("textarea");
  box.id = "json-schema";
  box.dataset.testid = "json-schema";
  box.rows = 4;
  box.placeholder = '{"type": "object", "properties": {"answer": {"type": "string"}}}';
  box.value = localStorage.getItem(KEY) || "";
  box.addEventListener("input", () => localStorage.setItem(KEY, box.value));
  row.after(label, box);
}

// The request's response_format field ({} for free text). Text that is not JSON is sent
// as it is: the server refuses it with a 400 naming the field, which the chat shows,
// rather than answering unconstrained.
export function responseFormat() {
  const text = (document.querySelector("#json-schema")?.value || "").trim();
  if (!text) return {};
  let schema = text;
  try {
    schema = JSON.parse(text);
  } catch {
    // left as text: see above
  }
  return { response_format: { type: "json_schema", json_schema: { name: "schema", schema } } };
}
