// One conversation on screen and the streaming chat request behind it: send, stop,
// regenerate the last reply, edit the last turn. Replies are painted at most once a frame
// from the text received so far; every message is stored when its reply ends.

import { postJSON, sseData } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { replyStats } from "./stats.js";
import { saveConversation } from "./store.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick) {
  const b = el("button", "small", label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

// The conversation as the API reads it: the system prompt first; replies that failed
// before any text are left out.
function requestMessages(conv) {
  const out = conv.system.trim() ? [{ role: "system", content: conv.system }] : [];
  for (const m of conv.messages) {
    if (m.role === "assistant" && !m.content && m.error) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

export class ChatView {
  // els: { messages, prompt, send, stop }; hooks: { model(), settings(), saved() }
  constructor(els, hooks) {
    this.els = els;
    this.hooks = hooks;
    this.conv = null;
    this.controller = null; // the AbortController of the reply streaming now
  }

  get busy() {
    return this.controller !== null;
  }

  open(conv) {
    this.conv = conv;
    this.render();
  }

  render() {
    const nodes = this.conv.messages.map((m, i) => this.messageNode(m, i));
    this.els.messages.replaceChildren(...nodes);
    this.els.messages.scrollTop = this.els.messages.scrollHeight;
  }

  messageNode(m, i) {
    const node = el("article", `msg ${m.role}`);
    node.dataset.role = m.role;
    const last = i === this.conv.messages.length - 1;
    if (m.role === "assistant") {
      this.fillReply(node, m);
    } else {
      node.append(el("div", "text", m.content));
    }
    const actions = el("div", "actions");
    if (!this.busy && m.role === "user" && (last || i === this.conv.messages.length - 2)) {
      actions.append(button("Edit", () => this.editLast()));
    }
    if (!this.busy && m.role === "assistant" && last) {
      actions.append(button("Regenerate", () => this.regenerate()));
    }
    if (actions.childElementCount) node.append(actions);
    return node;
  }

  // The reply's parts: reasoning (collapsed), the Markdown body, an error, the numbers.
  fillReply(node, m) {
    const parts = [];
    if (m.reasoning) {
      const details = el("details", "reasoning");
      details.append(el("summary", null, "Reasoning"));
      details.appendChild(el("div", "md")).append(renderMarkdown(m.reasoning));
      parts.push(details);
    }
    const body = el("div", "md body");
    body.append(renderMarkdown(m.content));
    parts.push(body);
    if (m.finish === "stopped") parts.push(el("p", "note", "Stopped."));
    if (m.error) parts.push(el("p", "error", m.error));
    const stats = replyStats(m.usage, m.timing);
    if (stats) parts.push(el("p", "stats", stats));
    if (m.timing && typeof m.timing.firstTokenMs === "number") {
      node.dataset.firstTokenMs = String(m.timing.firstTokenMs);
    }
    node.replaceChildren(...parts);
  }

  async submit(text) {
    if (this.busy || !text.trim()) return;
    this.conv.messages.push({ role: "user", content: text });
    await this.reply();
  }

  async regenerate() {
    const msgs = this.conv.messages;
    if (this.busy || !msgs.length || msgs[msgs.length - 1].role !== "assistant") return;
    msgs.pop();
    await this.reply();
  }

  // The last user turn goes back into the composer, and its reply away.
  editLast() {
    if (this.busy) return;
    const msgs = this.conv.messages;
    while (msgs.length && msgs[msgs.length - 1].role === "assistant") msgs.pop();
    const turn = msgs.pop();
    if (turn) this.els.prompt.value = turn.content;
    saveConversation(this.conv);
    this.hooks.saved();
    this.render();
    this.els.prompt.focus();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  setBusy(busy) {
    this.els.send.hidden = busy;
    this.els.stop.hidden = !busy;
  }

  async reply() {
    const conv = this.conv;
    const m = { role: "assistant", content: "", reasoning: "" };
    let body;
    try {
      body = {
        ...this.hooks.settings(),
        model: this.hooks.model(),
        messages: requestMessages(conv),
        stream: true,
        stream_options: { include_usage: true },
      };
    } catch (err) {
      conv.messages.push({ ...m, error: err.message });
      this.render();
      return;
    }
    conv.model = body.model;
    conv.messages.push(m);
    this.controller = new AbortController();
    this.setBusy(true);
    this.render();
    const node = this.els.messages.lastElementChild;
    const sent = performance.now();
    let frame = 0;
    const paint = () => {
      frame = 0;
      if (!m.timing && (m.content || m.reasoning)) {
        m.timing = { firstTokenMs: performance.now() - sent };
      }
      this.fillReply(node, m);
      this.els.messages.scrollTop = this.els.messages.scrollHeight;
    };
    try {
      const res = await postJSON("/v1/chat/completions", body, this.controller.signal);
      for await (const chunk of sseData(res)) {
        if (chunk.usage) m.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta) {
          m.content += choice.delta.content || "";
          m.reasoning += choice.delta.reasoning_content || "";
        }
        if (choice && choice.finish_reason) m.finish = choice.finish_reason;
        if (!frame) frame = requestAnimationFrame(paint);
      }
    } catch (err) {
      if (err.name === "AbortError") m.finish = "stopped";
      else m.error = err.message;
    }
    if (frame) cancelAnimationFrame(frame);
    if (!m.timing && (m.content || m.reasoning)) {
      m.timing = { firstTokenMs: performance.now() - sent }; // the stream ended within a frame
    }
    this.controller = null;
    this.setBusy(false);
    if (!m.reasoning) delete m.reasoning;
    saveConversation(conv);
    this.hooks.saved();
    if (this.conv === conv) this.render();
  }
}
