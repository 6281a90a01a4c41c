#!/usr/bin/env bash
# Vendors the web chat's third-party JavaScript and CSS into bargein/server/static/vendor/
# from the npm registry, at pinned versions, and records their licenses there.
#
#   scripts/vendor_web.sh            (needs npm and the registry; nothing is fetched at run time)
#
# markdown-it renders answers (the page turns its `html` option off, so raw HTML in model
# output stays text); highlight.js colours code blocks. Only their minified browser builds
# are copied. The bundle of markdown-it includes its runtime dependencies, so their licenses
# are recorded too (argparse is used by markdown-it's command line only and is not bundled).
set -euo pipefail

MARKDOWN_IT=15.0.3
HIGHLIGHT_JS=11.12.0   # @highlightjs/cdn-assets: highlight.js's prebuilt browser files

repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="$repo/bargein/server/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

npm install --prefix "$work" --no-save --no-audit --no-fund --ignore-scripts --omit=dev \
    "markdown-it@$MARKDOWN_IT" "@highlightjs/cdn-assets@$HIGHLIGHT_JS" >/dev/null
nm="$work/node_modules"

rm -rf "$dest"
mkdir -p "$dest"
cp "$nm/markdown-it/dist/browser/markdown-it.esm.min.mjs" "$dest/markdown-it.min.js"
cp "$nm/@highlightjs/cdn-assets/es/highlight.min.js" "$dest/highlight.min.js"
cp "$nm/@highlightjs/cdn-assets/styles/github.min.css" "$dest/highlight-light.min.css"
cp "$nm/@highlightjs/cdn-assets/styles/github-dark.min.css" "$dest/highlight-dark.min.css"
# The sourceMappingURL comment would make browsers' devtools ask for a file we do not ship.
sed -i '/^\/\/# sourceMappingURL=/d' "$dest/markdown-it.min.js"

# One file with each package's name, version, license and full license text.
{
  echo "Third-party code in bargein/server/static/vendor/, written by scripts/vendor_web.sh."
  echo "Files: markdown-it.min.js (markdown-it and the dependencies bundled in it),"
  echo "highlight.min.js and highlight-*.min.css (highlight.js)."
  for pkg in markdown-it entities linkify-it mdurl punycode.js uc.micro @highlightjs/cdn-assets; do
    dir="$nm/$pkg"
    node -e 'const p = require(process.argv[1]); console.log(`\n==== ${p.name} ${p.version} (${p.license}) ====\n`)' \
      "$dir/package.json"
    license="$(ls "$dir" | grep -iE '^(license|licence|copying)' | head -n1 || true)"
    if [ -n "$license" ]; then cat "$dir/$license"; else echo "(the package ships no license file; see its package.json)"; fi
  done
} > "$dest/THIRD_PARTY_LICENSES.txt"

echo "vendored into $dest:"
ls -l "$dest"
