// The page's start: the model picker (a switch loads the model through /api/load), the
// conversation list, the API-key dialog, and the wiring between the panels.

import { getJSON, onKeyNeeded, postJSON } from "./api.js";
import { ChatView } from "./chat.js";
import { SettingsPanel } from "./settings.js";
import { ServerPanel } from "./stats.js";
import {
  deleteConversation, getConversation, listConversations, newConversation, saveConversation,
} from "./store.js";

const $ = (id) => document.getElementById(id);

const cards = new Map(); // model id -> its /v1/models card
let current = null; // the model requests name

const settings = new SettingsPanel($("settings"));
const chat = new ChatView(
  { messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop") },
  { model: () => current, settings: () => settings.values(), saved: () => listChats() },
);

function status(text, kind = "") {
  $("model-status").textContent = text;
  $("model-status").dataset.kind = kind;
}

// --- the API key: asked once, kept for this tab ---------------------------------------

onKeyNeeded((retrying) => new Promise((resolve) => {
  const dialog = $("key-dialog");
  $("key-message").textContent = retrying
    ? "That key was refused. Enter this server's API key."
    : "This server needs an API key (kiln serve --api-key).";
  $("key-input").value = "";
  const form = $("key-form");
  const done = (key) => {
    form.removeEventListener("submit", onSubmit);
    dialog.removeEventListener("cancel", onCancel);
    dialog.close();
    resolve(key);
  };
  const onSubmit = (event) => {
    event.preventDefault();
    done($("key-input").value.trim() || null);
  };
  const onCancel = () => done(null);
  form.addEventListener("submit", onSubmit);
  dialog.addEventListener("cancel", onCancel);
  dialog.showModal();
}));

// --- models ----------------------------------------------------------------------------

async function listModels() {
  const { data } = await getJSON("/v1/models");
  cards.clear();
  const select = $("model");
  select.replaceChildren();
  for (const card of data) {
    cards.set(card.id, card);
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.loaded ? `${card.id} (loaded)` : card.id;
    select.append(option);
  }
  const loaded = data.find((c) => c.loaded);
  current = loaded ? loaded.id : (data[0] && data[0].id);
  select.value = current;
  if (current) settings.show(cards.get(current));
}

// /api/load answers once the model is in memory: until then the page says how long it has
// waited, and nothing can be sent.
async function loadModel(model) {
  const select = $("model");
  const started = performance.now();
  const tick = () => status(`Loading ${model}… ${((performance.now() - started) / 1000).toFixed(0)} s`, "busy");
  tick();
  const timer = setInterval(tick, 500);
  select.disabled = $("send").disabled = $("reload").disabled = true;
  try {
    const answer = await (await postJSON("/api/load", { model })).json();
    await listModels();
    status(`${answer.model} loaded in ${((performance.now() - started) / 1000).toFixed(1)} s`, "ok");
    return true;
  } catch (err) {
    status(`Loading ${model} failed: ${err.message}`, "error");
    select.value = current;
    return false;
  } finally {
    clearInterval(timer);
    select.disabled = $("send").disabled = $("reload").disabled = false;
  }
}

$("model").addEventListener("change", (event) => loadModel(event.target.value));

$("reload").addEventListener("click", async () => {
  if (current && (await loadModel(current))) settings.clear();
});

// --- conversations ----------------------------------------------------------------------

function listChats() {
  const items = listConversations().map((conv) => {
    const li = document.createElement("li");
    if (chat.conv && conv.id === chat.conv.id) li.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conv.title || "New chat";
    open.addEventListener("click", () => openChat(getConversation(conv.id)));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete small";
    del.textContent = "×";
    del.title = `Delete "${conv.title || "New chat"}"`;
    del.setAttribute("aria-label", del.title);
    del.addEventListener("click", () => {
      deleteConversation(conv.id);
      if (chat.conv && chat.conv.id === conv.id) openChat(newConversation(current));
      else listChats();
    });
    li.append(open, del);
    return li;
  });
  $("conversation-list").replaceChildren(...items);
}

function openChat(conv) {
  if (chat.busy) return;
  chat.open(conv);
  $("system-prompt").value = conv.system;
  $("system-box").open = Boolean(conv.system);
  document.body.classList.remove("show-left", "show-right");
  listChats();
}

$("new-conversation").addEventListener("click", () => openChat(newConversation(current)));

$("system-prompt").addEventListener("input", (event) => {
  chat.conv.system = event.target.value;
  if (chat.conv.messages.length) saveConversation(chat.conv);
});

// --- the composer and the drawers -------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.busy || $("send").disabled) return;
  $("prompt").value = "";
  chat.submit(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => chat.stop());

$("toggle-conversations").addEventListener("click", () => {
  document.body.classList.remove("show-right");
  document.body.classList.toggle("show-left");
});
$("toggle-settings").addEventListener("click", () => {
  document.body.classList.remove("show-left");
  document.body.classList.toggle("show-right");
});

// --- start --------------------------------------------------------------------------------

async function start() {
  openChat(listConversations()[0] || newConversation(null));
  new ServerPanel($("server-stats")).start();
  try {
    await listModels();
    status(`${current} ready`, "ok");
  } catch (err) {
    status(`Could not list the models: ${err.message}`, "error");
  }
}

start();
