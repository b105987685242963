// The sampling panel: every field of the contract, each showing the model's default (from
// its /v1/models card) as a placeholder. A field is sent only when the user filled it in;
// what is filled in is kept per model in localStorage, so it survives a page reload.

const ITEM = "kiln.settings";

// [name, integer?, what an empty field means when the card has no default]
export const FIELDS = [
  ["temperature", false],
  ["top_p", false],
  ["top_k", true],
  ["min_p", false],
  ["presence_penalty", false],
  ["frequency_penalty", false],
  ["repetition_penalty", false],
  ["repeat_last_n", true],
  ["seed", true, "random"],
  ["max_tokens", true, "up to the context"],
];

function readStored() {
  try {
    const all = JSON.parse(localStorage.getItem(ITEM) || "{}");
    return all && typeof all === "object" ? all : {};
  } catch {
    return {};
  }
}

export class SettingsPanel {
  constructor(form) {
    this.form = form;
    this.model = null;
    this.inputs = new Map();
    for (const [name, integer, noDefault] of FIELDS) {
      const label = document.createElement("label");
      const input = document.createElement("input");
      input.type = "number";
      input.name = name;
      input.step = integer ? "1" : "any";
      input.inputMode = integer ? "numeric" : "decimal";
      input.dataset.noDefault = noDefault || "";
      input.addEventListener("input", () => this.remember());
      label.append(document.createTextNode(name), input);
      form.append(label);
      this.inputs.set(name, input);
    }
  }

  // Shows `card`'s defaults and what the user set for that model before.
  show(card) {
    this.model = card.id;
    const set = readStored()[card.id] || {};
    for (const [name, input] of this.inputs) {
      const def = card.defaults ? card.defaults[name] : undefined;
      input.placeholder = def === undefined || def === null
        ? input.dataset.noDefault || "server's" : `default ${def}`;
      input.value = set[name] ?? "";
      input.setCustomValidity("");
    }
  }

  remember() {
    const all = readStored();
    const set = {};
    for (const [name, input] of this.inputs) if (input.value !== "") set[name] = input.value;
    all[this.model] = set;
    localStorage.setItem(ITEM, JSON.stringify(all));
  }

  // Forgets what the user set for the model (after a reload restored its defaults).
  clear() {
    for (const input of this.inputs.values()) input.value = "";
    this.remember();
  }

  // The fields to send: only those filled in. A value that is not a number (or not a
  // whole number where one is needed) is an Error naming the field.
  values() {
    const out = {};
    for (const [name, integer] of FIELDS) {
      const input = this.inputs.get(name);
      const text = input.value.trim();
      if (input.validity.badInput) throw new Error(`${name}: not a number`);
      if (text === "") continue;
      const value = Number(text);
      if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
        const what = integer ? "a whole number" : "a number";
        input.setCustomValidity(`${name} must be ${what}`);
        throw new Error(`${name} must be ${what}, not "${text}"`);
      }
      input.setCustomValidity("");
      out[name] = value;
    }
    return out;
  }
}
