// A small Markdown renderer for model replies. It builds DOM nodes with createElement and
// textContent only: model text is never parsed as HTML, so a reply holding `<img onerror>`
// shows those characters and runs nothing. What it knows: paragraphs, fenced code blocks
// (with a copy button), headings, bullet and numbered lists, block quotes, inline code,
// bold and italic. Anything else is shown as the text it is.

const FENCE = /^\s*(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
// Inline code first, so that `**` inside backticks stays literal.
const INLINE = /`([^`\n]+)`|\*\*(\S(?:[^]*?\S)?)\*\*|__(\S(?:[^]*?\S)?)__|\*(\S(?:[^*]*?\S)?)\*|(?<![\w])_(\S(?:[^_]*?\S)?)_(?![\w])/g;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1] !== undefined) {
      parent.append(el("code", null, m[1]));
    } else if (m[2] !== undefined || m[3] !== undefined) {
      renderInline(m[2] ?? m[3], parent.appendChild(el("strong")));
    } else {
      renderInline(m[4] ?? m[5], parent.appendChild(el("em")));
    }
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  return parent;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Plain http on another host is no secure context: the old way still works there.
  const area = el("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused to copy");
}

function codeBlock(lang, text) {
  const box = el("div", "code");
  const head = box.appendChild(el("div", "code-head"));
  head.append(el("span", "lang", lang || "code"));
  const button = head.appendChild(el("button", "copy", "Copy"));
  button.type = "button";
  button.addEventListener("click", () => {
    copyText(text).then(
      () => { button.textContent = "Copied"; },
      (err) => { button.textContent = `Copy failed: ${err.message}`; },
    );
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  box.appendChild(el("pre")).append(el("code", null, text));
  return box;
}

function list(lines, ordered, start) {
  const node = el(ordered ? "ol" : "ul");
  if (ordered && start !== 1) node.start = start;
  for (const line of lines) renderInline(line, node.appendChild(el("li")));
  return node;
}

// Consecutive lines matching `re`, from `i`; returns [captured texts, next index].
function run(lines, i, re, group) {
  const out = [];
  while (i < lines.length && re.test(lines[i])) out.push(lines[i++].match(re)[group]);
  return [out, i];
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) ||
    NUMBERED.test(line) || QUOTE.test(line) || RULE.test(line);
}

// A document fragment for `source`. A fence still open (a reply mid-stream) runs to the end.
export function renderMarkdown(source) {
  const out = document.createDocumentFragment();
  const lines = source.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
      i++;
      out.append(codeBlock(m[2], body.join("\n")));
    } else if ((m = line.match(HEADING))) {
      // h3 and below: the page's own headings are h1 and h2.
      out.append(renderInline(m[2], el(`h${Math.min(m[1].length + 2, 6)}`)));
      i++;
    } else if (RULE.test(line)) {
      out.append(el("hr"));
      i++;
    } else if (BULLET.test(line)) {
      const [items, next] = run(lines, i, BULLET, 1);
      out.append(list(items, false, 1));
      i = next;
    } else if ((m = line.match(NUMBERED))) {
      const [items, next] = run(lines, i, NUMBERED, 2);
      out.append(list(items, true, Number(m[1])));
      i = next;
    } else if (QUOTE.test(line)) {
      const [quoted, next] = run(lines, i, QUOTE, 1);
      out.appendChild(el("blockquote")).append(renderMarkdown(quoted.join("\n")));
      i = next;
    } else {
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) {
        para.push(lines[i]);
      }
      const p = el("p");
      para.forEach((text, k) => {
        if (k) p.append(el("br"));
        renderInline(text, p);
      });
      out.append(p);
    }
  }
  return out;
}
