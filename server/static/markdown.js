// A small Markdown renderer that builds DOM nodes: model text only ever reaches the page through
// textContent, never as HTML. Covers fenced code (with a copy button), headings, lists, quotes,
// paragraphs, **bold**, *italic* and `code`; anything else stays plain text.

function el(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Inline spans: `code`, **bold**, *italic*, appended to `parent` as text and elements.
const INLINE = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\s][^*\n]*\*)/;

function inline(parent, text) {
  for (const part of text.split(INLINE)) {
    if (!part) continue;
    if (part.startsWith("`") && part.endsWith("`") && part.length > 1) {
      parent.append(el("code", part.slice(1, -1)));
    } else if (part.startsWith("**") && part.endsWith("**") && part.length > 4) {
      parent.append(el("strong", part.slice(2, -2)));
    } else if (part.startsWith("*") && part.endsWith("*") && part.length > 2) {
      parent.append(el("em", part.slice(1, -1)));
    } else {
      parent.append(document.createTextNode(part));
    }
  }
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (err) {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

function codeBlock(lang, lines) {
  const wrap = el("div");
  wrap.className = "code";
  const head = el("div");
  head.className = "code-head";
  head.append(el("span", lang || "code"));
  const button = el("button", "Copy");
  button.type = "button";
  button.className = "copy";
  const text = lines.join("\n");
  button.setAttribute("aria-label", "Copy code");
  button.addEventListener("click", () => copyText(text, button));
  head.append(button);
  const pre = el("pre");
  pre.append(el("code", text));
  wrap.append(head, pre);
  return wrap;
}

// Block structure, line by line. An unclosed fence (a reply still streaming) renders as code so far.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) {
      const p = el("p");
      para.forEach((line, i) => {
        if (i) p.append(el("br"));
        inline(p, line);
      });
      out.append(p);
      para = [];
    }
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+.-]*)\s*$/);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      out.append(codeBlock(fence[1], code));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
    if (heading) {
      flush();
      const h = el(`h${Math.min(heading[1].length + 2, 6)}`);
      inline(h, heading[2]);
      out.append(h);
    } else if (item) {
      const tag = item[1] ? "ul" : "ol";
      if (para.length || !list || list.tagName.toLowerCase() !== tag) {
        flush();
        list = el(tag);
        out.append(list);
      }
      const li = el("li");
      inline(li, item[3]);
      list.append(li);
    } else if (line.startsWith(">")) {
      flush();
      const quote = el("blockquote");
      inline(quote, line.replace(/^>\s?/, ""));
      out.append(quote);
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) list = null;
      para.push(line);
    }
  }
  flush();
  return out;
}
