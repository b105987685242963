// Speed where people look: the line under each reply (from its usage block) and the server
// panel (from /health and /metrics, polled every few seconds).

import { getJSON, getText } from "./api.js";

const POLL_MS = 3000;

function fixed(x, digits) {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "?";
}

// One reply's numbers: kiln's usage (contract.md, "Responses"), and the time the page saw
// its first token (`timing.firstTokenMs`, from sending to the first text shown).
export function replyStats(usage, timing) {
  const parts = [];
  if (usage) {
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(
      `${usage.completion_tokens} tokens`,
      `${fixed(usage.decoding_speed_tps, 1)} tok/s`,
      `TTFT ${fixed(usage.prefill_duration_ttft * 1000, 0)} ms`,
      `${cached} of ${usage.prompt_tokens} prompt tokens cached`,
      `KV ${fixed(usage.kv_token_occupancy_rate_percentage, 1)} %`,
    );
  }
  if (timing && typeof timing.firstTokenMs === "number") {
    parts.push(`first text in page ${fixed(timing.firstTokenMs, 0)} ms`);
  }
  return parts.join(" · ");
}

// Prometheus text -> { metric name: value summed over its label sets }.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{.*\})?\s+(\S+)/);
    if (!m) continue;
    const value = Number(m[3]);
    if (Number.isFinite(value)) out[m[1]] = (out[m[1]] || 0) + value;
  }
  return out;
}

export class ServerPanel {
  constructor(list) {
    this.list = list;
    this.previous = null; // { at, finished }: requests per second over the last poll
    this.timer = null;
  }

  start() {
    const tick = async () => {
      await this.refresh();
      this.timer = setTimeout(tick, POLL_MS);
    };
    tick();
  }

  async refresh() {
    try {
      const [health, text] = await Promise.all([getJSON("/health"), getText("/metrics")]);
      this.show(health, parseMetrics(text));
    } catch (err) {
      this.render([["server", `unreachable: ${err.message}`]]);
    }
  }

  show(health, m) {
    const now = performance.now();
    const finished = m["kiln:request_success_total"] || 0;
    let rate = "…";
    if (this.previous) {
      const seconds = (now - this.previous.at) / 1000;
      rate = fixed((finished - this.previous.finished) / seconds, 2);
    }
    this.previous = { at: now, finished };
    const queries = m["kiln:prefix_cache_queries_total"] || 0;
    const hits = m["kiln:prefix_cache_hits_total"] || 0;
    this.render([
      ["status", `${health.status} · ${health.model}`],
      ["running", String(m["kiln:num_requests_running"] ?? "?")],
      ["waiting", String(m["kiln:num_requests_waiting"] ?? "?")],
      ["in flight", String(health.in_flight)],
      ["KV blocks used", `${m["kiln:kv_blocks_used"] ?? "?"} of ${m["kiln:kv_blocks_total"] ?? "?"}`],
      ["prefix-cache hits", queries ? `${fixed((100 * hits) / queries, 1)} % of prompt tokens` : "none yet"],
      ["requests/s", rate],
    ]);
  }

  render(rows) {
    const nodes = [];
    for (const [name, value] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      dd.dataset.stat = name;
      nodes.push(dt, dd);
    }
    this.list.replaceChildren(...nodes);
  }
}
