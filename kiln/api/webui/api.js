// Every call the page makes to kiln goes through here: the API key is added in one place,
// a 401 asks for it once (however many calls were refused together), and an answer that is
// not 2xx becomes an ApiError carrying the server's own message.

const KEY_ITEM = "kiln.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let askForKey = null; // (retrying: bool) => Promise<string | null>
let pendingKey = null; // the one question in progress, shared by every refused call
let declined = false; // the user closed the question: not asked again until a reload

export function onKeyNeeded(ask) {
  askForKey = ask;
}

function keyFromUser(refusedKey) {
  if (declined) return Promise.resolve(null);
  if (!pendingKey) {
    pendingKey = askForKey(refusedKey !== null).then((key) => {
      declined = !key;
      return key;
    }).finally(() => { pendingKey = null; });
  }
  return pendingKey;
}

async function errorMessage(res) {
  const text = await res.text();
  try {
    const body = JSON.parse(text);
    const err = body.error;
    if (typeof err === "string") return err;
    if (err && typeof err.message === "string") return err.message;
  } catch {
    // not JSON: the text itself is the message
  }
  return text || `HTTP ${res.status}`;
}

// fetch() with the key; a 401 asks for a key and tries again with it.
export async function call(path, init = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = new Headers(init.headers || {});
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const res = await fetch(path, { ...init, headers });
    if (res.status === 401 && askForKey) {
      // Another call may have been given a key while this one was under way.
      const current = sessionStorage.getItem(KEY_ITEM);
      const next = current !== key ? current : await keyFromUser(key);
      if (next) {
        sessionStorage.setItem(KEY_ITEM, next);
        continue;
      }
    }
    if (!res.ok) {
      const message = await errorMessage(res);
      throw new ApiError(res.status, res.status === 401 && declined
        ? `${message} (reload the page to enter a key)` : message);
    }
    return res;
  }
}

export async function getJSON(path) {
  return (await call(path)).json();
}

export async function getText(path) {
  return (await call(path)).text();
}

export async function postJSON(path, body, signal) {
  const res = await call(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  return res;
}

// The JSON objects of a `data:` SSE stream, up to `data: [DONE]`. An `error` object sent
// in-band (a failure after the stream began) is thrown.
export async function* sseData(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data === "[DONE]") return;
      if (!data) continue;
      const event = JSON.parse(data);
      if (event.error) {
        throw new ApiError(500, event.error.message || JSON.stringify(event.error));
      }
      yield event;
    }
  }
}
