// Conversations kept in this browser (localStorage), newest first. A conversation:
// { id, title, model, system, updated, messages: [{ role, content, reasoning?, usage?,
//   timing?, finish?, error? }] }.
// Stored data that does not parse (another version, a hand edit) is set aside, not fatal.

const ITEM = "kiln.conversations";

function valid(conv) {
  return conv && typeof conv.id === "string" && Array.isArray(conv.messages) &&
    conv.messages.every((m) => m && typeof m.role === "string" && typeof m.content === "string");
}

function readAll() {
  const raw = localStorage.getItem(ITEM);
  if (!raw) return [];
  try {
    const all = JSON.parse(raw);
    if (Array.isArray(all)) return all.filter(valid).map((c) => ({ title: "", system: "", ...c }));
  } catch {
    // fall through: keep the unreadable text under another name, start afresh
  }
  localStorage.setItem(`${ITEM}.unreadable`, raw);
  localStorage.removeItem(ITEM);
  return [];
}

function writeAll(all) {
  localStorage.setItem(ITEM, JSON.stringify(all));
}

export function listConversations() {
  return readAll().sort((a, b) => (b.updated || 0) - (a.updated || 0));
}

export function getConversation(id) {
  return readAll().find((c) => c.id === id) || null;
}

export function newConversation(model) {
  const id = (crypto.randomUUID && crypto.randomUUID()) ||
    `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  return { id, title: "", model, system: "", updated: Date.now(), messages: [] };
}

export function saveConversation(conv) {
  const first = conv.messages.find((m) => m.role === "user");
  conv.title = first ? first.content.slice(0, 60) : "New chat";
  conv.updated = Date.now();
  const all = readAll().filter((c) => c.id !== conv.id);
  all.push(conv);
  writeAll(all);
}

export function deleteConversation(id) {
  writeAll(readAll().filter((c) => c.id !== id));
}
