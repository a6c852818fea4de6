// Crucible lineage page: search, a layered DAG of the selected node's lineage (SVG), node details,
// trace to sources and provenance report export. Plain JS, no build step, no external assets.
"use strict";

const API = "/api/v1";
const SVG_NS = "http://www.w3.org/2000/svg";
const NODE_W = 220, NODE_H = 48, PAD = 24;
// gaps between layers / between nodes of a layer, per orientation
const GAPS = { LR: { layer: 80, node: 16 }, TB: { layer: 44, node: 18 } };

// graph: what is drawn (the pages loaded, merged, plus a node per "N more" group); nodes/edges/groups:
// the pages' content by id; page: the last page of the first-page chain (its nextCursor pages on)
const state = { nodeId: null, selected: null, graph: null, layout: null, scale: 1, detail: null,
  lastQuery: null, searchSeq: 0, graphSeq: 0, nodes: new Map(), edges: new Map(), groups: new Map(), page: null };
const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------------------------------------
// helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "className") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, v);
  return node;
}

async function getJSON(path, params = {}) {
  const qs = new URLSearchParams(params).toString();
  const resp = await fetch(`${API}${path}${qs ? "?" + qs : ""}`);
  if (!resp.ok) {
    let msg = resp.statusText;
    try { msg = (await resp.json()).detail || msg; } catch (e) { /* not JSON */ }
    throw new Error(`${resp.status}: ${msg}`);
  }
  return resp.json();
}

function status(msg) {
  const s = $("status");
  s.textContent = msg || "";
  s.hidden = !msg;
}

function splitNodeId(id) {  // display only: type, and the rest
  const i = id.indexOf(":");
  return { type: id.slice(0, i).toUpperCase(), rest: id.slice(i + 1) };
}

function shortHash(v) { return v ? v.slice(0, 12) : ""; }

function fmtTime(t) { return t ? t.replace("T", " ").replace(/\.\d+Z$/, "Z") : ""; }

function truncate(s, n) { return s && s.length > n ? s.slice(0, n - 1) + "…" : (s || ""); }

function sourceFacet(data) {  // a raw file's licence and provenance
  const f = data && data.facets && data.facets.crucible_source;
  return f && typeof f === "object" && !f.derived ? f : null;
}

function derivedFacet(data) {  // the licences a derived artifact carries (union of its raw sources)
  const f = data && data.facets && data.facets.crucible_source;
  return f && typeof f === "object" && f.derived ? f : null;
}

function licenceCount(f) {
  const n = (f.licences || []).length;
  return `${n} licence${n === 1 ? "" : "s"} upstream`;
}

function isModel(ns, name) { return ns.startsWith("mlflow://") && /^models\/.+\/[^/]+$/.test(name); }

function nodeKind(n) {
  if (n.type === "GROUP") return "group";
  if (n.type === "JOB") return "job";
  const d = n.data || {};
  if (isModel(d.namespace || "", d.name || "")) return "model";
  if (sourceFacet(d)) return "source";
  return "dataset";
}

function groupText(g) {  // "558 more datasets", "3+ more (2 datasets, 1 job)": "+" while the walk has more to find
  const kinds = Object.entries(g.types).map(([t, c]) => `${c} ${t.toLowerCase()}${c === 1 ? "" : "s"}`);
  const count = `${g.count}${g.atLeast ? "+" : ""}`;
  return kinds.length === 1 ? `${count} more ${kinds[0].replace(/^\d+ /, "")}` : `${count} more (${kinds.join(", ")})`;
}

function nodeLabel(n) {
  const d = n.data || {};
  if (n.type === "GROUP") return groupText(d);
  if (n.type === "JOB") return d.name || n.id;
  const name = d.name || "";
  if (isModel(d.namespace || "", name)) {
    const parts = name.split("/");
    return `${parts.slice(1, -1).join("/")} v${parts[parts.length - 1]}`;
  }
  const segs = name.split("/").filter(Boolean);
  return segs.slice(-2).join("/") || name;
}

function nodeSub(n) {
  const d = n.data || {};
  if (n.type === "GROUP") return "click: show them";
  if (n.type === "JOB") {
    const runs = d.crucible ? d.crucible.runCount ?? (d.crucible.runs || []).length : 0;
    return `job · ${runs} run${runs === 1 ? "" : "s"}`;
  }
  const src = sourceFacet(d);
  if (src) return src.licence || "no licence recorded";
  const derived = derivedFacet(d);
  if (derived && !isModel(d.namespace || "", d.name || "")) return licenceCount(derived);
  const versions = (d.crucible && d.crucible.versions) || [];
  const count = d.crucible ? d.crucible.versionCount ?? versions.length : 0;
  const v = count === 1 ? versions[0] : d.currentVersion;
  const extra = count > 1 ? ` (+${count - 1})` : "";
  return v ? `sha256 ${shortHash(v)}${extra}` : d.namespace || "";
}

// ---------------------------------------------------------------------------------------------
// search

let searchTimer = null;

async function runSearch(q) {
  clearTimeout(searchTimer);
  q = (q || "").trim();
  if (q === state.lastQuery) return;  // already shown: keep the elements (and any selection) as they are
  state.lastQuery = q;
  const seq = ++state.searchSeq;
  const list = $("search-results");
  if (!q) { list.replaceChildren(); $("results-count").textContent = ""; return; }
  list.dataset.state = "loading";
  try {
    const res = await getJSON("/search", { q, limit: 50 });
    if (seq !== state.searchSeq) return;  // a newer search is under way
    $("results-count").textContent = `(${res.totalCount})`;
    $("results-hint").hidden = res.results.length > 0;
    // model versions first: they are what an auditor usually starts from
    const rank = (r) => (isModel(r.namespace, r.name) ? 0 : r.type === "DATASET" ? 1 : 2);
    const rows = res.results.slice().sort((a, b) => rank(a) - rank(b));
    list.replaceChildren(...rows.map((r) => el("li", {},
      el("button", {
        type: "button", className: "result" + (r.nodeId === state.nodeId ? " active" : ""),
        "data-testid": "search-result", "data-node-id": r.nodeId, "data-type": r.type,
        title: r.nodeId, onclick: () => selectRoot(r.nodeId),
      },
      el("span", { className: "r-name", text: isModel(r.namespace, r.name) ? `${r.name}` : r.name }),
      el("span", { className: "r-meta", text: `${r.type.toLowerCase()} · ${r.namespace}` +
        (r.licence ? ` · ${truncate(r.licence, 40)}` : "") })))));
    list.dataset.state = "ready";
    list.dataset.query = q;
    status("");
  } catch (e) {
    status(`Search failed: ${e.message}`);
  }
}

// ---------------------------------------------------------------------------------------------
// graph layout: cycle breaking, longest-path layers, barycentre ordering

function layout(graph) {
  const ids = graph.map((n) => n.id).sort();
  const byId = new Map(graph.map((n) => [n.id, n]));
  const edges = [];
  for (const n of graph) for (const e of n.outEdges) if (byId.has(e.destination)) edges.push([e.origin, e.destination]);
  const adj = new Map(ids.map((id) => [id, []]));
  for (const [a, b] of edges) adj.get(a).push(b);

  const color = new Map(), back = new Set();
  for (const s of ids) {
    if (color.get(s)) continue;
    color.set(s, 1);
    const stack = [[s, 0]];
    while (stack.length) {
      const top = stack[stack.length - 1];
      const next = adj.get(top[0]);
      if (top[1] < next.length) {
        const v = next[top[1]++];
        const c = color.get(v) || 0;
        if (c === 0) { color.set(v, 1); stack.push([v, 0]); }
        else if (c === 1) back.add(top[0] + "\u0000" + v);
      } else { color.set(top[0], 2); stack.pop(); }
    }
  }
  const dag = edges.filter(([a, b]) => !back.has(a + "\u0000" + b));
  const indeg = new Map(ids.map((id) => [id, 0]));
  const succ = new Map(ids.map((id) => [id, []])), pred = new Map(ids.map((id) => [id, []]));
  for (const [a, b] of dag) { indeg.set(b, indeg.get(b) + 1); succ.get(a).push(b); pred.get(b).push(a); }
  const layer = new Map(ids.map((id) => [id, 0]));
  const queue = ids.filter((id) => indeg.get(id) === 0);
  for (let qi = 0; qi < queue.length; qi++) {
    const u = queue[qi];
    for (const v of succ.get(u)) {
      layer.set(v, Math.max(layer.get(v), layer.get(u) + 1));
      indeg.set(v, indeg.get(v) - 1);
      if (indeg.get(v) === 0) queue.push(v);
    }
  }
  // pull sources right, next to their first consumer (keeps raw files near ingest)
  for (const id of ids) {
    if (pred.get(id).length === 0 && succ.get(id).length) {
      const minSucc = Math.min(...succ.get(id).map((v) => layer.get(v)));
      layer.set(id, Math.max(layer.get(id), minSucc - 1));
    }
  }
  const nLayers = Math.max(0, ...layer.values()) + 1;
  const layers = Array.from({ length: nLayers }, () => []);
  for (const id of ids) layers[layer.get(id)].push(id);
  const pos = new Map();
  const setPos = () => layers.forEach((l) => l.forEach((id, i) => pos.set(id, i)));
  for (const l of layers) l.sort((a, b) => nodeLabel(byId.get(a)).localeCompare(nodeLabel(byId.get(b))));
  setPos();
  const bary = (id, nbrs) => {
    const ps = nbrs.get(id).map((v) => pos.get(v));
    return ps.length ? ps.reduce((x, y) => x + y, 0) / ps.length : pos.get(id);
  };
  for (let iter = 0; iter < 6; iter++) {
    const down = iter % 2 === 0;
    const order = down ? layers.slice(1) : layers.slice(0, -1).reverse();
    for (const l of order) {
      const keys = new Map(l.map((id) => [id, bary(id, down ? pred : succ)]));
      l.sort((a, b) => keys.get(a) - keys.get(b));
      l.forEach((id, i) => pos.set(id, i));
    }
  }
  const maxRows = Math.max(1, ...layers.map((l) => l.length));
  // deep, narrow graphs (a pipeline's chain) read better top to bottom
  const pick = $("orientation").value;
  const orient = pick === "auto" ? (nLayers > 2 * maxRows && nLayers > 5 ? "TB" : "LR") : pick;
  const gap = GAPS[orient];
  const along = orient === "LR" ? NODE_W : NODE_H, across = orient === "LR" ? NODE_H : NODE_W;
  const coords = new Map();
  layers.forEach((l, li) => {
    const offset = ((maxRows - l.length) * (across + gap.node)) / 2;
    l.forEach((id, i) => {
      const a = PAD + li * (along + gap.layer), b = PAD + offset + i * (across + gap.node);
      coords.set(id, orient === "LR" ? { x: a, y: b } : { x: b, y: a });
    });
  });
  const length = PAD * 2 + nLayers * along + (nLayers - 1) * gap.layer;
  const breadth = PAD * 2 + maxRows * across + (maxRows - 1) * gap.node;
  return {
    coords, edges, back, orient,
    width: orient === "LR" ? length : breadth,
    height: orient === "LR" ? breadth : length,
  };
}

function edgePath(p, q, isBack, orient) {
  if (orient === "TB") {
    const x1 = p.x + NODE_W / 2, y1 = p.y + NODE_H, x2 = q.x + NODE_W / 2, y2 = q.y;
    if (isBack || y2 <= y1) {
      return `M ${p.x + NODE_W} ${p.y + NODE_H / 2} C ${p.x + NODE_W + 90} ${p.y}, ${q.x + NODE_W + 90} ${q.y + NODE_H},` +
        ` ${q.x + NODE_W} ${q.y + NODE_H / 2}`;
    }
    const dy = Math.max(24, (y2 - y1) / 2);
    return `M ${x1} ${y1} C ${x1} ${y1 + dy}, ${x2} ${y2 - dy}, ${x2} ${y2}`;
  }
  const x1 = p.x + NODE_W, y1 = p.y + NODE_H / 2, x2 = q.x, y2 = q.y + NODE_H / 2;
  if (isBack || x2 <= x1) return `M ${x1} ${y1} C ${x1 + 70} ${y1 - 90}, ${x2 - 70} ${y2 - 90}, ${x2} ${y2}`;
  const dx = Math.max(40, (x2 - x1) / 2);
  return `M ${x1} ${y1} C ${x1 + dx} ${y1}, ${x2 - dx} ${y2}, ${x2} ${y2}`;
}

function renderGraph() {
  const box = $("graph");
  const graph = state.graph || [];
  if (!graph.length) { box.replaceChildren(el("p", { className: "hint", text: "No lineage found." })); return; }
  const lay = state.layout;
  const root = svg("svg", {
    id: "graph-svg", "data-testid": "graph-svg", "data-orientation": lay.orient, viewBox: `0 0 ${lay.width} ${lay.height}`,
    width: Math.round(lay.width * state.scale), height: Math.round(lay.height * state.scale),
  });
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#98a2b3" }));
  defs.append(marker);
  const clip = svg("clipPath", { id: "node-clip" });
  clip.append(svg("rect", { x: 4, y: 0, width: NODE_W - 10, height: NODE_H }));
  defs.append(clip);
  root.append(defs);
  const edgeLayer = svg("g", { class: "edges" });
  for (const [a, b] of lay.edges) {
    const d = edgePath(lay.coords.get(a), lay.coords.get(b), lay.back.has(a + "\u0000" + b), lay.orient);
    edgeLayer.append(svg("path", {
      d, class: "edge" + (lay.back.has(a + "\u0000" + b) ? " back" : ""), "marker-end": "url(#arrow)",
      "data-origin": a, "data-destination": b,
    }));
  }
  root.append(edgeLayer);
  const byId = new Map(graph.map((n) => [n.id, n]));
  for (const [id, c] of lay.coords) {
    const n = byId.get(id);
    const kind = nodeKind(n);
    const src = sourceFacet(n.data);
    const g = svg("g", {
      class: `node ${kind}${id === state.nodeId ? " start" : ""}${id === state.selected ? " selected" : ""}`,
      transform: `translate(${c.x},${c.y})`, "data-testid": "graph-node", "data-node-id": id,
      "data-node-type": n.type, "data-kind": kind,
      "data-licence": src ? src.licence : null, "data-source": src ? src.source : null,
    });
    const title = svg("title");
    title.textContent = src ? `${id}\nsource: ${src.source}\nlicence: ${src.licence}` :
      kind === "group" ? `${nodeLabel(n)} of ${n.data.parent}'s ${n.data.direction} fan-out` : id;
    g.append(title);
    if (kind === "group") {
      Object.assign(g.dataset, { testid: "graph-group", count: String(n.data.count), parent: n.data.parent });
    }
    g.append(svg("rect", { width: NODE_W, height: NODE_H, rx: n.type === "JOB" ? 22 : 6 }));
    const kindText = svg("text", { x: 10, y: 13, class: "kind" });
    kindText.textContent = { job: "JOB", source: "SOURCE", model: "MODEL VERSION", dataset: "DATASET", group: "MORE" }[kind];
    const label = svg("text", { x: 10, y: 28, class: "label" });
    label.textContent = truncate(nodeLabel(n), 34);
    const sub = svg("text", { x: 10, y: 42, class: "sub", "data-testid": src ? "node-licence" : null });
    sub.textContent = truncate(nodeSub(n), 33);
    const texts = svg("g", { "clip-path": "url(#node-clip)" });
    texts.append(kindText, label, sub);
    g.append(texts);
    if (kind === "group") g.addEventListener("click", () => loadPage(n.data.cursor, id));
    else {
      g.addEventListener("click", () => selectDetail(id));
      g.addEventListener("dblclick", () => selectRoot(id));
    }
    root.append(g);
  }
  box.replaceChildren(root);
}

function fitScale() {  // the whole graph in view (zoom in from there); answers are bounded, so it stays usable
  if (!state.layout) return;
  const box = $("graph");
  const w = (box.clientWidth - 16) / state.layout.width, h = (box.clientHeight - 16) / state.layout.height;
  state.scale = Math.max(0.02, Math.min(1.1, w, h));
}

// ---------------------------------------------------------------------------------------------
// selection

async function selectRoot(nodeId) {
  state.nodeId = nodeId;
  state.selected = nodeId;
  const params = new URLSearchParams({ node: nodeId, direction: $("direction").value, depth: $("depth").value });
  history.replaceState(null, "", "#" + params.toString());
  document.querySelectorAll(".result").forEach((b) => b.classList.toggle("active", b.dataset.nodeId === nodeId));
  await Promise.all([loadGraph(), selectDetail(nodeId)]);
}

async function loadGraph() {
  if (!state.nodeId) return;
  const { type, rest } = splitNodeId(state.nodeId);
  $("graph-title").textContent = `${type === "JOB" ? "Job" : "Dataset"} ${rest}`;
  const seq = ++state.graphSeq;
  const box = $("graph");
  box.dataset.state = "loading";
  try {
    const direction = $("direction").value;
    const res = await getJSON("/lineage", graphParams());
    if (seq !== state.graphSeq) return;  // a newer graph was asked for
    state.nodes = new Map(); state.edges = new Map(); state.groups = new Map();
    mergePage(res);
    state.page = res.page;
    showGraph();
    Object.assign(box.dataset, { state: "ready", root: state.nodeId, direction });
    status("");
  } catch (e) {
    status(`Graph failed: ${e.message}`);
  }
}

function graphParams(cursor) {
  const params = { nodeId: state.nodeId, depth: $("depth").value || 20, direction: $("direction").value,
    limit: $("limit").value || 200 };
  if (cursor) params.cursor = cursor;
  return params;
}

function mergePage(res) {  // a page's nodes, its edges (within it and to earlier pages) and its groups
  for (const n of res.graph) {
    state.nodes.set(n.id, n);
    for (const e of n.outEdges) state.edges.set(e.origin + "\u0000" + e.destination, e);
  }
  for (const e of (res.page && res.page.earlierEdges) || []) state.edges.set(e.origin + "\u0000" + e.destination, e);
  for (const g of res.groups || []) state.groups.set(g.id, g);
}

function showGraph() {  // lay out what is loaded, each remaining fan-out as one "N more" node, and fit it
  const out = new Map([...state.nodes.keys()].map((id) => [id, []]));
  for (const e of state.edges.values()) if (out.has(e.origin) && state.nodes.has(e.destination)) out.get(e.origin).push(e);
  const graph = [...state.nodes.values()].map((n) => ({ ...n, outEdges: out.get(n.id) }));
  for (const g of state.groups.values()) {
    if (!state.nodes.has(g.parent)) continue;
    const edge = g.direction === "downstream" ? { origin: g.parent, destination: g.id } : { origin: g.id, destination: g.parent };
    const node = { id: g.id, type: "GROUP", data: g, inEdges: [], outEdges: g.direction === "upstream" ? [edge] : [] };
    if (g.direction === "downstream") graph.find((n) => n.id === g.parent).outEdges.push(edge);
    graph.push(node);
  }
  // the toolbar first: its height decides the box's, which the fit reads
  const total = state.page ? state.page.totalNodes : state.nodes.size;
  $("graph-more").hidden = !(state.page && state.page.nextCursor);
  // the walk goes only as far as the pages loaded: until it is done the total is what it has found
  const more = state.page && !state.page.complete ? "+" : "";
  $("graph-count").textContent = `${state.nodes.size} of ${total}${more} nodes`;
  state.graph = graph;
  state.layout = graph.length ? layout(graph) : null;
  fitScale();
  renderGraph();
  Object.assign($("graph").dataset, { nodes: String(state.nodes.size), total: String(total),
    groups: String(state.groups.size), scale: String(state.scale) });
}

async function loadPage(cursor, groupId) {  // a group's nodes (from its cursor) or the next page, merged in
  if (!cursor) return;
  const box = $("graph");
  box.dataset.state = "loading";
  try {
    const res = await getJSON("/lineage", graphParams(cursor));
    if (groupId) state.groups.delete(groupId);
    else state.page = res.page;
    mergePage(res);
    showGraph();
    box.dataset.state = "ready";
  } catch (e) {
    status(`Graph failed: ${e.message}`);
  }
}

function fact(tbody, label, value, opts = {}) {
  if (value === null || value === undefined || value === "") return;
  const td = el("td", { className: opts.className || null, "data-testid": opts.testid || null });
  if (opts.mono) td.append(el("code", { text: String(value) })); else td.textContent = String(value);
  tbody.append(el("tr", {}, el("th", { text: label }), td));
}

async function selectDetail(nodeId) {
  state.selected = nodeId;
  document.querySelectorAll("#graph .node").forEach((g) => g.classList.toggle("selected", g.dataset.nodeId === nodeId));
  document.querySelectorAll("#graph .edge").forEach((p) =>
    p.classList.toggle("hl", p.dataset.origin === nodeId || p.dataset.destination === nodeId));
  let d;
  try {
    d = await getJSON("/crucible/node", { nodeId });
  } catch (e) {
    status(`Details failed: ${e.message}`);
    return;
  }
  state.detail = d;
  $("detail-empty").hidden = true;
  $("detail").hidden = false;
  $("detail").dataset.nodeId = nodeId;
  const model = d.type === "DATASET" && d.isModelVersion;
  const badge = $("detail-type");
  const raw = d.source && !d.source.derived;
  badge.textContent = model ? "MODEL VERSION" : raw ? "RAW SOURCE" : d.type;
  badge.className = "badge " + (model ? "MODEL" : raw ? "SOURCE" : d.type);
  $("detail-name").textContent = d.name;
  $("detail-namespace").textContent = `namespace ${d.namespace}`;

  const q = new URLSearchParams({ nodeId, download: "true" });
  $("export-md").href = `${API}/crucible/report?${q}&format=md`;
  $("export-json").href = `${API}/crucible/report?${q}&format=json`;

  const tbody = $("detail-facts").tBodies[0];
  tbody.replaceChildren();
  fact(tbody, "node id", nodeId, { mono: true });
  const doc = d.data && d.data.facets && d.data.facets.documentation;
  if (doc && typeof doc === "object") fact(tbody, "about", doc.description, { testid: "detail-about" });
  if (d.type === "DATASET") {
    fact(tbody, "version", d.version, { mono: true, testid: "detail-version" });
    if (d.versions && d.versions.length > 1) fact(tbody, "versions", `${d.versions.length} recorded`);
    if (d.source && d.source.derived) {
      fact(tbody, "raw sources", d.source.source);
      fact(tbody, "licences", (d.source.licences || []).join("\n") || d.source.licence,
           { className: "licence", testid: "detail-licences" });
    } else if (d.source) {
      fact(tbody, "source", d.source.source);
      fact(tbody, "licence", d.source.licence, { className: "licence", testid: "detail-licence" });
      fact(tbody, "provenance", d.source.provenance);
    }
    if (d.rowCount) {
      fact(tbody, "rows", d.rowCount.rows, { testid: "detail-rows" });
      fact(tbody, "bytes", d.rowCount.bytes);
    }
    fact(tbody, "first seen", fmtTime(d.data.createdAt));
    fact(tbody, "last written", fmtTime(d.data.lastModifiedAt));
  } else {
    fact(tbody, "job type", d.jobType);
    fact(tbody, "runs", d.runs.length);
    fact(tbody, "parent", d.data.parentJobName);
  }

  const links = $("detail-links");
  links.replaceChildren(...(d.links || []).map((l) =>
    el("a", { href: l.url, target: "_blank", rel: "noopener", "data-testid": "detail-link", text: `${l.label} ↗` })));

  const runs = $("detail-runs").tBodies[0];
  const rows = [];
  if (d.type === "DATASET") {
    for (const [role, list] of [["written by", d.producers], ["read by", d.consumers]]) {
      for (const r of list || []) rows.push([role, r.job, r.runId, r.state, r.at]);
    }
  } else {
    for (const r of d.runs || []) rows.push(["run", d.name, r.runId, r.state, r.startedAt]);
  }
  runs.replaceChildren(...rows.slice(0, 30).map(([role, job, run, st, at]) =>
    el("tr", { "data-testid": "detail-run", "data-run-id": run },
      el("td", { text: role }),
      el("td", {}, el("div", { text: job }), el("code", { className: "muted", title: run, text: `${run.slice(0, 8)} · ${fmtTime(at)}` })),
      el("td", { text: st || "" }))));
  if (!rows.length) runs.append(el("tr", {}, el("td", { colspan: 3, className: "muted", text: "none recorded" })));

  const facets = $("detail-facets");
  const all = Object.entries(d.data.facets || {});
  facets.replaceChildren(...all.map(([name, f]) => {
    const clean = Object.fromEntries(Object.entries(f || {}).filter(([k]) => !k.startsWith("_")));
    return el("details", { "data-testid": "facet", "data-facet": name, open: name === "crucible_source" || null },
      el("summary", { text: name }), el("pre", { text: JSON.stringify(clean, null, 2) }));
  }));
  if (!all.length) facets.append(el("p", { className: "muted", text: "No facets." }));
}

// ---------------------------------------------------------------------------------------------
// trace to sources

async function showTrace(nodeId) {
  let t;
  try {
    t = await getJSON("/crucible/trace", { nodeId });
  } catch (e) {
    status(`Trace failed: ${e.message}`);
    return;
  }
  const panel = $("trace-panel");
  panel.hidden = false;
  panel.dataset.nodeId = nodeId;
  $("trace-title").textContent = nodeId;
  const lic = Object.entries(t.licences);
  $("trace-licences").replaceChildren(
    el("strong", { text: `${t.sources.length} source file(s), ${lic.length} licence(s)` }),
    el("ul", {}, ...lic.map(([l, names]) => el("li", { "data-testid": "trace-licence" },
      el("span", { className: "licence", text: l }), ` — ${names.join(", ")}`))));
  const warnings = [];
  if (t.unlicensed.length) warnings.push(`${t.unlicensed.length} source(s) without a licence: ${t.unlicensed.join(", ")}`);
  if (t.truncated) warnings.push("The trace stopped at the depth limit; deeper lineage exists.");
  $("trace-warnings").replaceChildren(...warnings.map((w) => el("p", { className: "warn", text: w })));
  $("trace-table").tBodies[0].replaceChildren(...t.sources.map((s) => el("tr", {
    "data-testid": "trace-source", "data-node-id": s.nodeId, "data-licence": s.licence || "",
  },
  el("td", { text: s.source || "—" }),
  el("td", { className: s.licence ? "licence" : "warn", text: s.licence || "none recorded" }),
  el("td", { text: s.provenance || "" }),
  el("td", {}, el("code", { text: s.name })),
  el("td", { title: s.version || "" }, el("code", { text: shortHash(s.version) })),
  el("td", { text: s.rows ?? "" }),
  el("td", { text: (s.readBy || []).join(", ") }))));
  panel.scrollIntoView({ behavior: "smooth", block: "start" });
}

// ---------------------------------------------------------------------------------------------
// wiring

async function loadStats() {
  try {
    const s = await getJSON("/crucible/stats");
    $("stats").textContent = `${s.events} events · ${s.jobs} jobs · ${s.runs} runs · ${s.datasets} datasets`;
  } catch (e) { /* the page still works without */ }
}

function init() {
  $("search-form").addEventListener("submit", (ev) => { ev.preventDefault(); runSearch($("search-input").value); });
  window.addEventListener("resize", () => { if (state.layout) { fitScale(); renderGraph(); } });
  $("search-input").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => runSearch($("search-input").value), 250);
  });
  $("graph-refresh").addEventListener("click", loadGraph);
  $("direction").addEventListener("change", loadGraph);
  $("orientation").addEventListener("change", () => { if (state.graph && state.graph.length) showGraph(); });
  $("depth").addEventListener("change", loadGraph);
  $("limit").addEventListener("change", loadGraph);
  $("graph-more").addEventListener("click", () => state.page && loadPage(state.page.nextCursor));
  $("zoom-in").addEventListener("click", () => { state.scale = Math.min(3, state.scale * 1.25); renderGraph(); });
  $("zoom-out").addEventListener("click", () => { state.scale = Math.max(0.2, state.scale / 1.25); renderGraph(); });
  $("zoom-fit").addEventListener("click", () => { fitScale(); renderGraph(); });
  $("focus-button").addEventListener("click", () => state.selected && selectRoot(state.selected));
  $("trace-button").addEventListener("click", () => state.selected && showTrace(state.selected));
  const stats = loadStats();
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("node")) {
    if (params.get("direction")) $("direction").value = params.get("direction");
    if (params.get("depth")) $("depth").value = params.get("depth");
    selectRoot(params.get("node"));
  }
  // ready once the header's figures are in (a test read them before they were on a loaded machine)
  stats.then(() => { document.body.dataset.ready = "true"; });
}

document.addEventListener("DOMContentLoaded", init);
