// Markdown of model answers, rendered by the vendored markdown-it and highlight.js
// (vendor/, written by scripts/vendor_web.sh; nothing is fetched at run time).
//
// Model output is untrusted. markdown-it runs with `html: false`, so raw HTML in the text
// is escaped like any other character; its link check refuses javascript:, vbscript:,
// file: and data: URLs (such a link stays plain text); images are switched off, so an
// answer cannot make the page load anything. Code is highlighted by highlight.js, whose
// output escapes the code it colours.

import MarkdownIt from "./vendor/markdown-it.min.js";
import hljs from "./vendor/highlight.min.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const md = new MarkdownIt({ html: false, linkify: true, breaks: true, typographer: false });
md.disable("image");

// Links open in a new tab and tell the target nothing about this page.
md.renderer.rules.link_open = (tokens, idx, options, env, self) => {
  tokens[idx].attrSet("target", "_blank");
  tokens[idx].attrSet("rel", "noopener noreferrer");
  return self.renderToken(tokens, idx, options);
};

function highlighted(code, lang) {
  if (lang && hljs.getLanguage(lang)) {
    try {
      return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    } catch { /* fall through to plain text */ }
  }
  return escapeHtml(code);
}

// A fenced block gets a header with its language and a Copy button. An unterminated fence
// (the usual state while an answer streams) runs to the end of the text, as in CommonMark.
md.renderer.rules.fence = (tokens, idx) => {
  const token = tokens[idx];
  const lang = token.info.trim().split(/\s+/)[0] || "";
  const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "<span></span>";
  const cls = lang ? ` class="hljs language-${escapeHtml(lang)}"` : ' class="hljs"';
  return `<div class="code-block"><div class="code-head">${label}` +
    '<button type="button" class="copy-code" title="Copy code">Copy</button></div>' +
    `<pre><code${cls}>${highlighted(token.content.replace(/\n$/, ""), lang)}</code></pre></div>\n`;
};

// Tables scroll sideways on a narrow screen instead of widening the page.
md.renderer.rules.table_open = () => '<div class="table-wrap"><table>\n';
md.renderer.rules.table_close = () => "</table></div>\n";

// Table cells' alignment as a class, not a style attribute: the page's Content-Security-Policy
// allows no inline styles.
for (const rule of ["th_open", "td_open"]) {
  md.renderer.rules[rule] = (tokens, idx, options, env, self) => {
    const token = tokens[idx];
    const align = /text-align:\s*(left|right|center)/.exec(token.attrGet("style") || "");
    token.attrs = (token.attrs || []).filter(([name]) => name !== "style");
    if (align) token.attrJoin("class", `align-${align[1]}`);
    return self.renderToken(tokens, idx, options);
  };
}

// Render markdown to an HTML string that is safe to assign to innerHTML.
export function renderMarkdown(source) {
  return md.render(String(source ?? ""));
}
