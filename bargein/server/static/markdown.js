// A small markdown renderer that is safe by construction.
//
// Model output is untrusted. Every character of it is HTML-escaped first; only then are
// markdown constructs turned into the few tags this file emits itself (p, h1-h6, strong,
// em, code, pre, ul, ol, li, blockquote, a, button). No attribute value ever comes from the
// input except a link's href, which must be an http(s) URL and is escaped like the rest.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Inline markup of one escaped line. Code spans are cut out first so that nothing inside
// them is treated as markdown; they come back through \u0000<n>\u0000 placeholders, and
// the input can hold no \u0000 of its own (renderMarkdown strips them).
function inline(escaped) {
  const spans = [];
  const keep = (html) => `\u0000${spans.push(html) - 1}\u0000`;
  let s = escaped.replace(/`([^`]+)`/g, (_, code) => keep(`<code>${code}</code>`));
  s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, label, url) =>
    keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`));
  // Bare URLs, also inside quotes (escaped above, hence the entities in the pattern).
  s = s.replace(/(^|[\s(]|&quot;|&#39;|&lt;)(https?:\/\/(?:(?!&quot;|&#39;|&lt;|&gt;)[^\s)])*[^\s).,;:!?&])/g, (_, pre, url) =>
    pre + keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`));
  s = s.replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|\W)__(?=\S)(.+?)__(?!\w)/g, "$1<strong>$2</strong>");
  s = s.replace(/(^|[^*\w])\*(?=\S)([^*]+?)\*(?![*\w])/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_(?=\S)([^_]+?)_(?![_\w])/g, "$1<em>$2</em>");
  // Restore twice: a link label may itself contain a code span.
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
  return restore(restore(s));
}

function codeBlock(lang, lines) {
  const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "<span></span>";
  return `<div class="code-block"><div class="code-head">${label}` +
    `<button type="button" class="copy-code" title="Copy code">Copy</button></div>` +
    `<pre><code>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
}

const LIST_ITEM = /^\s{0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;

// Render markdown to an HTML string. An unterminated code fence (the usual state while an
// answer streams) runs to the end of the text.
export function renderMarkdown(source) {
  const lines = String(source ?? "").replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  let list = null; // { tag: "ul" | "ol", items: [] }
  const flushPara = () => {
    if (para.length) out.push(`<p>${para.map((l) => inline(escapeHtml(l))).join("<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(escapeHtml(i))}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  const flush = () => { flushPara(); flushList(); };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s{0,3}(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i++) body.push(lines[i]);
      out.push(codeBlock(fence[2], body));
      continue;
    }
    const heading = line.match(/^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/);
    const item = line.match(LIST_ITEM);
    if (heading) {
      flush();
      const n = heading[1].length;
      out.push(`<h${n}>${inline(escapeHtml(heading[2]))}</h${n}>`);
    } else if (item) {
      flushPara();
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (list && list.tag !== tag) flushList();
      list ??= { tag, items: [] };
      list.items.push(item[2]);
    } else if (/^\s*>/.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && /^\s*>/.test(lines[i]); i++) quoted.push(lines[i].replace(/^\s*>\s?/, ""));
      i--;
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flush();
      out.push("<hr>");
    } else if (!line.trim()) {
      flush();
    } else if (list && /^\s+\S/.test(line)) {
      list.items[list.items.length - 1] += " " + line.trim(); // continuation of an item
    } else {
      flushList();
      para.push(line);
    }
  }
  flush();
  return out.join("\n");
}
