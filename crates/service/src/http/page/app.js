// The guest page: a search form, its results, and a hotel's calendar whose
// free units are pushed by the server (EventSource on /v1/hotels/{id}/events).
// Plain JavaScript, no build step. The view lives in the URL hash:
//   #/?city=London&check_in=…&check_out=…&rooms=1&guests=2   search
//   #/hotels/42?from=…&to=…                                  a hotel
"use strict";

const $ = (id) => document.getElementById(id);
let events = null; // the open EventSource, if any
let lastSearch = ""; // the search shown, to keep the back link

function isoDay(offset) {
  const d = new Date();
  d.setUTCHours(0, 0, 0, 0);
  d.setUTCDate(d.getUTCDate() + offset);
  return d.toISOString().slice(0, 10);
}

function addDays(iso, n) {
  const d = new Date(iso + "T00:00:00Z");
  d.setUTCDate(d.getUTCDate() + n);
  return d.toISOString().slice(0, 10);
}

function money(cents) {
  if (cents === null || cents === undefined) return "no price";
  return "€" + (cents / 100).toFixed(2);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c);
  return e;
}

function setFreshness(lsn, lagMs, source) {
  const badge = $("freshness");
  badge.textContent = `lsn ${lsn} · lag ${lagMs} ms` + (source ? ` · ${source}` : "");
  badge.dataset.lsn = lsn;
}

function status(node, text, isError) {
  node.textContent = text;
  node.classList.toggle("error", Boolean(isError));
}

async function problemText(response) {
  try {
    const p = await response.json();
    return p.detail || p.title || response.statusText;
  } catch (_) {
    return response.statusText;
  }
}

// ---- search -----------------------------------------------------------------

function formParams() {
  const p = new URLSearchParams();
  p.set("city", $("city").value.trim());
  p.set("check_in", $("check-in").value);
  p.set("check_out", $("check-out").value);
  p.set("rooms", $("rooms").value);
  p.set("guests", $("guests").value);
  return p;
}

function fillForm(p) {
  if (p.get("city")) $("city").value = p.get("city");
  $("check-in").value = p.get("check_in") || $("check-in").value || isoDay(1);
  $("check-out").value = p.get("check_out") || $("check-out").value || isoDay(3);
  if (p.get("rooms")) $("rooms").value = p.get("rooms");
  if (p.get("guests")) $("guests").value = p.get("guests");
}

async function runSearch(p) {
  const q = new URLSearchParams();
  q.set("city", p.get("city"));
  q.set("check_in", p.get("check_in"));
  q.set("check_out", p.get("check_out"));
  const rooms = Math.max(1, Math.min(8, Number(p.get("rooms")) || 1));
  for (let i = 0; i < rooms; i++) q.append("room", p.get("guests") || "2");
  q.set("limit", "20");
  const node = $("search-status");
  status(node, "Searching…");
  $("results").replaceChildren();
  document.body.dataset.searchState = "loading";
  let response;
  try {
    response = await fetch("/v1/search?" + q.toString());
  } catch (e) {
    status(node, "The server did not answer: " + e, true);
    document.body.dataset.searchState = "error";
    return;
  }
  if (!response.ok) {
    status(node, "Search failed: " + (await problemText(response)), true);
    document.body.dataset.searchState = "error";
    return;
  }
  const answer = await response.json();
  setFreshness(answer.lsn, answer.lag_ms, null);
  const stay = `from=${p.get("check_in")}&to=${addDays(p.get("check_in"), 14)}`;
  const items = answer.results.map((h) => renderHotel(h, stay));
  $("results").replaceChildren(...items);
  const hotels = answer.total_hotels === 1 ? "1 hotel can" : `${answer.total_hotels} hotels can`;
  status(node, `${hotels} host you · numbers as of lsn ${answer.lsn}, ${answer.lag_ms} ms behind the owner`);
  document.body.dataset.searchState = "done";
}

// Each room type's source as a badge: labelled with the API's own word
// (what the README and /v1/stale-reads count by), coloured per source in
// style.css, and explained in its title. An unknown source still shows,
// by its name, in the plain badge colour.
const SOURCES = {
  copy: () => "from the read copy, as of the answer's lsn",
  owner: () => "read from the owner while answering (few units left, or min_lsn)",
  copy_fallback: () => "from the read copy: the owner should have been read but did not answer in time",
  confirmed: (t) => "from the read copy, after it caught up with the owner's position"
    + (t.confirmed_lsn ? ` at lsn ${t.confirmed_lsn}` : ""),
};

function sourceBadge(t) {
  const explain = SOURCES[t.source];
  const title = explain ? explain(t) : "where this room type's numbers came from";
  return el("span", { class: "badge " + t.source, title }, t.source);
}

function renderHotel(h, stay) {
  const stars = h.stars ? " · " + "★".repeat(h.stars) : "";
  const offers = h.room_types.map((t) =>
    el("li", { class: "offer", "data-room-type-id": t.room_type_id },
      el("span", { class: "name" }, `${t.name} (up to ${t.max_guests})`),
      el("span", { class: "free" + (t.low_availability ? " low" : "") }, `${t.free_units} free`),
      el("span", { class: "price" }, money(t.price_cents)),
      sourceBadge(t)));
  return el("li", { class: "result", "data-hotel-id": h.hotel_id },
    el("h2", {}, el("a", { href: `#/hotels/${h.hotel_id}?${stay}` }, h.name)),
    el("div", { class: "meta" }, `${h.city}${stars} · from ${money(h.price_cents)} for the stay`),
    el("ul", { class: "offers" }, ...offers));
}

function showSearch(p) {
  $("hotel-view").hidden = true;
  $("search-view").hidden = false;
  fillForm(p);
  if (p.get("city") && p.get("check_in") && p.get("check_out")) {
    lastSearch = "#/?" + p.toString();
    runSearch(p);
  }
}

// ---- one hotel, live ----------------------------------------------------------

function showHotel(id, p) {
  $("search-view").hidden = true;
  $("hotel-view").hidden = false;
  $("back").href = lastSearch || "#/";
  const from = p.get("from") || isoDay(1);
  const to = p.get("to") || addDays(from, 14);
  $("hotel-name").textContent = `Hotel ${id}`;
  $("grid").replaceChildren();
  const node = $("hotel-status");
  status(node, "Connecting…");
  const view = { cells: new Map(), updates: 0, lsn: null };
  document.body.dataset.hotelState = "connecting";
  events = new EventSource(`/v1/hotels/${id}/events?from=${from}&to=${to}`);
  events.addEventListener("state", (e) => {
    const s = JSON.parse(e.data);
    if (s.name) $("hotel-name").textContent = `${s.name}, ${s.city}`;
    renderGrid(view, s, from, to);
    view.lsn = s.lsn;
    setFreshness(s.lsn, s.lag_ms, "copy");
    liveStatus(node, view);
    document.body.dataset.hotelState = "live";
  });
  events.addEventListener("change", (e) => {
    const c = JSON.parse(e.data);
    for (const n of c.nights) {
      const cell = view.cells.get(n.room_type_id + "|" + n.night);
      if (cell) setCell(cell, n.removed ? null : n.free, true);
    }
    view.updates += 1;
    view.lsn = c.lsn;
    setFreshness(c.lsn, 0, "copy");
    liveStatus(node, view);
  });
  events.onerror = () => {
    // The browser reconnects by itself and sends Last-Event-ID.
    status(node, "Connection lost; reconnecting…", true);
    document.body.dataset.hotelState = "reconnecting";
  };
}

function liveStatus(node, view) {
  status(node, `live · ${view.updates} changes pushed · lsn ${view.lsn}`);
}

function renderGrid(view, s, from, to) {
  const nights = [];
  for (let d = from; d < to; d = addDays(d, 1)) nights.push(d);
  const head = el("tr", {}, el("th", { class: "rt" }, "room type"),
    ...nights.map((n) => {
      const d = new Date(n + "T00:00:00Z");
      const label = d.toLocaleDateString(undefined, { weekday: "short", day: "numeric", month: "short", timeZone: "UTC" });
      return el("th", { title: n }, label);
    }));
  view.cells = new Map();
  const rows = s.room_types.map((rt) => {
    const cells = nights.map((n) => {
      const td = el("td", { class: "free", "data-rt": rt.room_type_id, "data-night": n });
      setCell(td, null, false);
      view.cells.set(rt.room_type_id + "|" + n, td);
      return td;
    });
    return el("tr", {}, el("th", { class: "rt" }, `${rt.name} (up to ${rt.max_guests})`), ...cells);
  });
  for (const n of s.nights) {
    const td = view.cells.get(n.room_type_id + "|" + n.night);
    if (td) setCell(td, n.removed ? null : n.free, false);
  }
  $("grid").replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
}

function setCell(td, free, flash) {
  td.textContent = free === null ? "–" : String(free);
  td.dataset.free = free === null ? "" : String(free);
  td.classList.toggle("full", free !== null && free <= 0);
  td.classList.toggle("few", free !== null && free > 0 && free <= 2);
  if (flash) {
    td.classList.add("flash");
    setTimeout(() => td.classList.remove("flash"), 60);
  }
}

// ---- routing --------------------------------------------------------------------

function route() {
  if (events) {
    events.close();
    events = null;
  }
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const p = new URLSearchParams(query || "");
  const hotel = path.match(/^\/hotels\/(\d+)$/);
  if (hotel) showHotel(Number(hotel[1]), p);
  else showSearch(p);
}

$("search-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const target = "#/?" + formParams().toString();
  if (location.hash === target) route();
  else location.hash = target;
});
window.addEventListener("hashchange", route);
fillForm(new URLSearchParams());
route();
