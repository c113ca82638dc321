// retouch playground and dashboard. Plain JavaScript, no build step, no dependency.
// The token lives in localStorage and goes out as an Authorization header on every API call
// (see platform/api/web/__init__.py for why); nothing is sent anywhere but this gateway.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "retouch.token";
const UNDO_LIMIT = 40;
const DASHBOARD_EVERY_MS = 2000;

// ---- token and API ---------------------------------------------------------------------

function takeTokenFromFragment() {
  const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (m) {
    localStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function token() { return localStorage.getItem(TOKEN_KEY) || ""; }

function authHeaders(extra = {}) {
  const t = token();
  return t ? { ...extra, authorization: `Bearer ${t}` } : extra;
}

class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(`${err.code || "http_" + status}: ${err.message || "HTTP " + status}${err.field ? ` (field: ${err.field})` : ""}`);
    this.status = status;
    this.code = err.code;
  }
}

async function api(path, { method = "GET", body, raw = false } = {}) {
  const headers = authHeaders({ accept: "application/json" });
  let payload;
  if (body !== undefined) {
    headers["content-type"] = "application/msgpack";
    payload = msgpack.encode(body);
  }
  const resp = await fetch(path, { method, headers, body: payload });
  if (raw && resp.ok) return resp;
  const ctype = resp.headers.get("content-type") || "";
  const doc = ctype.includes("msgpack")
    ? msgpack.decode(new Uint8Array(await resp.arrayBuffer()))
    : ctype.includes("json") ? await resp.json() : null;
  if (!resp.ok) {
    if (resp.status === 401) setLoginState("token required", true);
    throw new ApiError(resp.status, doc);
  }
  return doc;
}

let toastTimer = null;
function toast(message, error = false) {
  const el = $("toast");
  el.textContent = message;
  el.className = error ? "error" : "";
  el.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.hidden = true; }, error ? 8000 : 3000);
}

function setLoginState(text, bad = false) {
  const el = $("login-state");
  el.textContent = text;
  el.style.color = bad ? "var(--bad)" : "";
}

// ---- functions and templates -------------------------------------------------------------

const state = {
  functions: {},        // name -> status document
  fn: null,             // the chosen function's document
  width: 0, height: 0,
  template: null,       // a template id, or null when an uploaded image is edited
  upload: null,         // PNG bytes of the uploaded image (resized to the function's size)
  originalUrl: null,
  job: null,            // {id, abort: AbortController}
  lastRequest: null,    // what was submitted, for "copy as curl"
};

async function loadFunctions() {
  let doc;
  try {
    doc = await api("/v1/functions");
  } catch (err) {
    if (err.status === 401 || err.status === 403) return;
    toast(err.message, true);
    return;
  }
  setLoginState(token() ? "token set" : "open server");
  const select = $("function");
  const previous = select.value;
  state.functions = Object.fromEntries(doc.functions.map((f) => [f.name, f]));
  select.replaceChildren(...doc.functions.map((f) => new Option(`${f.name} (${f.status})`, f.name)));
  if (!doc.functions.length) {
    $("function-info").textContent = "no function deployed (retouch deploy SPEC)";
    return;
  }
  select.value = state.functions[previous] ? previous : doc.functions[0].name;
  await chooseFunction();
}

async function chooseFunction() {
  const fn = state.functions[$("function").value];
  if (!fn) return;
  state.fn = fn;
  [state.width, state.height] = fn.resolution;
  $("function-info").textContent = `${fn.model} · ${state.width}×${state.height} · ${fn.steps} steps`;
  showExamples(fn.examples || []);
  resetSettings();
  const tpl = $("template");
  tpl.replaceChildren(...Object.keys(fn.templates).map((t) => new Option(`${t} (${fn.templates[t].state})`, t)));
  resizeCanvases();
  await chooseTemplate();
}

// The function's example prompts (spec field `examples`): a menu, the first one in the
// prompt box, so a first edit asks for something the model was trained to draw.
function showExamples(examples) {
  $("examples").replaceChildren(...examples.map((text) => new Option(text, text)));
  $("examples-label").hidden = examples.length === 0;
  $("prompt").value = examples.length ? examples[0] : "";
}

// The generation settings start at the function's own (its spec's steps and guidance) and
// strength 1 (repaint the mask fully), so an untouched form edits as the function does.
function resetSettings() {
  if (!state.fn) return;
  $("steps").value = String(state.fn.steps);
  $("guidance").value = String(state.fn.guidance);
  $("strength").value = "1";
}

async function chooseTemplate() {
  const tid = $("template").value;
  if (!tid) return;
  state.template = tid;
  state.upload = null;
  $("upload").value = "";
  const resp = await api(`/v1/functions/${encodeURIComponent(state.fn.name)}/templates/${encodeURIComponent(tid)}`, { raw: true });
  const blob = await resp.blob();
  await showOriginal(blob);
}

async function chooseUpload(file) {
  if (!file || !state.fn) return;
  // The function edits images of exactly its resolution: cover-fit and crop here.
  const bitmap = await createImageBitmap(file);
  const canvas = document.createElement("canvas");
  canvas.width = state.width;
  canvas.height = state.height;
  const ctx = canvas.getContext("2d");
  const scale = Math.max(state.width / bitmap.width, state.height / bitmap.height);
  const w = bitmap.width * scale, h = bitmap.height * scale;
  ctx.drawImage(bitmap, (state.width - w) / 2, (state.height - h) / 2, w, h);
  const blob = await new Promise((ok) => canvas.toBlob(ok, "image/png"));
  state.upload = new Uint8Array(await blob.arrayBuffer());
  state.template = null;
  await showOriginal(blob);
  toast(`uploaded image: ${bitmap.width}×${bitmap.height} → ${state.width}×${state.height}; its first edit runs in full, later ones mask-aware`);
}

async function showOriginal(blob) {
  if (state.originalUrl) URL.revokeObjectURL(state.originalUrl);
  state.originalUrl = URL.createObjectURL(blob);
  $("original").src = state.originalUrl;
  const bitmap = await createImageBitmap(blob);
  const ctx = $("image-canvas").getContext("2d");
  ctx.clearRect(0, 0, state.width, state.height);
  ctx.drawImage(bitmap, 0, 0, state.width, state.height);
}

// ---- mask painting ---------------------------------------------------------------------------

const mask = {
  ctx: null,
  drawing: false,
  eraser: false,
  last: null,
  undo: [],
  ratioQueued: false,
};

function resizeCanvases() {
  for (const id of ["image-canvas", "mask-canvas"]) {
    const c = $(id);
    if (c.width !== state.width || c.height !== state.height) {
      c.width = state.width;
      c.height = state.height;
    }
  }
  mask.ctx = $("mask-canvas").getContext("2d", { willReadFrequently: true });
  mask.undo = [];
  clearMask(false);
}

function snapshot() {
  mask.undo.push(mask.ctx.getImageData(0, 0, state.width, state.height));
  if (mask.undo.length > UNDO_LIMIT) mask.undo.shift();
}

function canvasPoint(event) {
  const c = $("mask-canvas");
  const r = c.getBoundingClientRect();
  return [(event.clientX - r.left) * (c.width / r.width), (event.clientY - r.top) * (c.height / r.height)];
}

function brushRadius() {
  // the slider is in pixels of a 512-wide view; scale to the image
  return Math.max(0.5, (Number($("brush").value) / 2) * (state.width / 512));
}

function stroke(from, to) {
  const ctx = mask.ctx;
  ctx.globalCompositeOperation = mask.eraser ? "destination-out" : "source-over";
  ctx.strokeStyle = ctx.fillStyle = "rgb(255, 40, 40)";
  ctx.lineWidth = brushRadius() * 2;
  ctx.lineCap = ctx.lineJoin = "round";
  ctx.beginPath();
  ctx.moveTo(...from);
  ctx.lineTo(...to);
  ctx.stroke();
  ctx.beginPath();
  ctx.arc(...to, brushRadius(), 0, Math.PI * 2);
  ctx.fill();
  queueRatio();
}

function onPointerDown(event) {
  if (!mask.ctx || event.button !== 0) return;
  event.preventDefault();
  $("mask-canvas").setPointerCapture(event.pointerId);
  snapshot();
  mask.drawing = true;
  mask.last = canvasPoint(event);
  stroke(mask.last, mask.last);
}

function onPointerMove(event) {
  if (!mask.drawing) return;
  const point = canvasPoint(event);
  stroke(mask.last, point);
  mask.last = point;
}

function onPointerUp() {
  mask.drawing = false;
  updateRatio();
}

// Selected pixels: alpha >= 128 (the brush's anti-aliased rim counts half-way).
function maskPixels() {
  return mask.ctx.getImageData(0, 0, state.width, state.height).data;
}

function updateRatio() {
  mask.ratioQueued = false;
  if (!mask.ctx) return;
  const data = maskPixels();
  let selected = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i] >= 128) selected++;
  const ratio = selected / (state.width * state.height);
  $("mask-ratio").textContent = `${(ratio * 100).toFixed(1)} %`;
  $("mask-ratio").dataset.ratio = String(ratio);
}

function queueRatio() {
  if (mask.ratioQueued) return;
  mask.ratioQueued = true;
  requestAnimationFrame(updateRatio);
}

function clearMask(undoable = true) {
  if (!mask.ctx) return;
  if (undoable) snapshot();
  mask.ctx.clearRect(0, 0, state.width, state.height);
  updateRatio();
}

function invertMask() {
  snapshot();
  const img = mask.ctx.getImageData(0, 0, state.width, state.height);
  const d = img.data;
  for (let i = 0; i < d.length; i += 4) {
    const on = d[i + 3] < 128;
    d[i] = 255; d[i + 1] = 40; d[i + 2] = 40; d[i + 3] = on ? 255 : 0;
  }
  mask.ctx.putImageData(img, 0, 0);
  updateRatio();
}

function undoMask() {
  const img = mask.undo.pop();
  if (img) {
    mask.ctx.putImageData(img, 0, 0);
    updateRatio();
  }
}

// The mask as this API wants it: white (edit) on black (keep), a PNG without alpha.
async function maskPng() {
  const data = maskPixels();
  const out = new ImageData(state.width, state.height);
  for (let i = 0; i < data.length; i += 4) {
    const v = data[i + 3] >= 128 ? 255 : 0;
    out.data[i] = out.data[i + 1] = out.data[i + 2] = v;
    out.data[i + 3] = 255;
  }
  const c = document.createElement("canvas");
  c.width = state.width;
  c.height = state.height;
  c.getContext("2d").putImageData(out, 0, 0);
  const blob = await new Promise((ok) => c.toBlob(ok, "image/png"));
  return new Uint8Array(await blob.arrayBuffer());
}

// ---- jobs: submit, follow (SSE over fetch, so the token travels as a header), cancel ------

// A number from a settings field, or an Error naming the field when it is empty, not a
// number or out of the field's range (Number("") would silently be 0).
function numberField(id, label, integer) {
  const input = $(id);
  const value = input.valueAsNumber;
  const bad = !Number.isFinite(value) || (integer && !Number.isSafeInteger(value)) ||
    value < Number(input.min) || (input.max !== "" && value > Number(input.max));
  if (bad) {
    const range = input.max !== "" ? `in ${input.min}–${input.max}` : `≥ ${input.min}`;
    throw new Error(`${label} must be ${integer ? "an integer" : "a number"} ${range}`);
  }
  return value;
}

// The job request, under diffusers' argument names (docs/api.md, "Invocation").
async function buildRequest() {
  const request = {
    mask: await maskPng(),
    prompt: $("prompt").value,
    seed: numberField("seed", "seed", true),
    num_inference_steps: numberField("steps", "steps", true),
    guidance_scale: numberField("guidance", "guidance", false),
    strength: numberField("strength", "strength", false),
    format: "png",
  };
  const negative = $("negative-prompt").value;
  if (negative) request.negative_prompt = negative;
  if (state.upload) request.image = state.upload;
  else request.template = state.template;
  return request;
}

async function submit() {
  if (!state.fn) return toast("choose a function first", true);
  if (Number($("mask-ratio").dataset.ratio || 0) === 0) return toast("paint the region to edit first", true);
  let request;
  try {
    request = await buildRequest();
  } catch (err) {
    return toast(err.message, true);
  }
  state.lastRequest = { fn: state.fn.name, ...request };
  $("copy-curl").disabled = false;
  setProgress(0, request.num_inference_steps);
  $("job-state").textContent = "submitting…";
  let doc;
  try {
    doc = await api(`/v1/functions/${encodeURIComponent(state.fn.name)}/jobs`, { method: "POST", body: request });
  } catch (err) {
    $("job-state").textContent = "refused";
    return toast(err.message, true);
  }
  follow(doc);
}

function setProgress(step, total) {
  const bar = $("progress");
  bar.max = total || 1;
  bar.value = step;
  $("progress-text").textContent = total ? `${step} / ${total}` : "";
}

function describeQueued(position) {
  return position === null || position === undefined ? "queued" : `queued · position ${position + 1}`;
}

async function follow(doc) {
  if (state.job) state.job.abort.abort();
  const job = { id: doc.id, abort: new AbortController(), ended: false };
  state.job = job;
  $("cancel").disabled = false;
  $("submit").disabled = true;
  $("job-state").textContent = `${describeQueued(doc.queue_position)} · job ${doc.id.slice(0, 8)}`;
  try {
    const resp = await fetch(`/v1/jobs/${doc.id}/events`, { headers: authHeaders(), signal: job.abort.signal });
    if (!resp.ok) throw new ApiError(resp.status, await resp.json().catch(() => null));
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const event = parseEvent(block);
        if (event) await onEvent(job, event);
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") toast(err.message, true);
  } finally {
    if (state.job === job) {
      $("cancel").disabled = true;
      $("submit").disabled = false;
    }
  }
}

function parseEvent(block) {
  let name = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // keep-alive comment
    const at = line.indexOf(":");
    const field = at < 0 ? line : line.slice(0, at);
    const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data += value;
  }
  return data ? { name, data: JSON.parse(data) } : null;
}

async function onEvent(job, event) {
  const id = job.id.slice(0, 8);
  const el = $("job-state");
  switch (event.name) {
    case "queued":
      el.textContent = `${describeQueued(event.data.position)} · job ${id}`;
      break;
    case "started":
      el.textContent = `running on ${event.data.executor}${event.data.attempt > 1 ? ` (attempt ${event.data.attempt})` : ""} · job ${id}`;
      break;
    case "progress":
      setProgress(event.data.step, event.data.total);
      el.textContent = `step ${event.data.step} of ${event.data.total}${event.data.eta_s != null ? ` · ${event.data.eta_s.toFixed(1)} s left` : ""} · job ${id}`;
      break;
    case "succeeded":
      job.ended = true;
      await showResult(job.id);
      break;
    case "failed":
      job.ended = true;
      el.textContent = `failed · job ${id}`;
      toast(`${event.data.error.code}: ${event.data.error.message}`, true);
      break;
    case "canceled":
      job.ended = true;
      el.textContent = `canceled · job ${id}`;
      break;
  }
}

async function showResult(jobId) {
  const doc = await api(`/v1/jobs/${jobId}`);
  const r = doc.result;
  const bytes = Uint8Array.from(atob(r.image), (c) => c.charCodeAt(0));
  const url = URL.createObjectURL(new Blob([bytes], { type: `image/${r.format}` }));
  const img = $("result");
  if (img.src.startsWith("blob:")) URL.revokeObjectURL(img.src);
  img.src = url;
  const link = $("download");
  link.href = url;
  link.download = `retouch-${jobId.slice(0, 8)}.${r.format}`;
  link.hidden = false;
  setProgress(r.engine.steps || $("progress").max, r.engine.steps || $("progress").max);
  $("job-state").textContent = `succeeded · job ${jobId.slice(0, 8)}`;
  const t = r.timings;
  $("result-info").textContent =
    `path ${r.path} · ${r.engine.steps} steps · ${(t.total_ms / 1000).toFixed(2)} s total (run ${(t.run_ms / 1000).toFixed(2)} s) · ` +
    `mask ${(r.mask_ratio * 100).toFixed(1)} % · ${r.executor}${r.template ? " · " + r.template : ""}`;
  img.dataset.job = jobId;
  img.dataset.path = r.path;
}

async function cancelJob() {
  if (!state.job) return;
  try {
    const doc = await api(`/v1/jobs/${state.job.id}/cancel`, { method: "POST" });
    $("job-state").textContent = `${doc.status} · job ${doc.id.slice(0, 8)}`;
  } catch (err) {
    toast(err.message, true);
  }
}

// ---- copy as curl: the same job request, as JSON --------------------------------------

function base64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function curlCommand() {
  const { fn, ...body } = state.lastRequest;
  const url = `${location.origin}/v1/functions/${fn}/jobs`;
  const json = JSON.stringify(body, (_, v) => (v instanceof Uint8Array ? base64(v) : v));
  const auth = token() ? ` \\\n  -H "authorization: Bearer $RETOUCH_TOKEN"` : "";
  return `# the job request this page sent, as JSON (images base64); answers the job document\n` +
    `curl -sS -X POST '${url}'${auth} \\\n` +
    `  -H 'content-type: application/json' --data-binary @- <<'JSON'\n${json}\nJSON`;
}

async function copyCurl() {
  if (!state.lastRequest) return;
  const text = curlCommand();
  const area = $("curl-text");
  area.value = text;
  area.hidden = false;
  try {
    await navigator.clipboard.writeText(text);
    toast("curl command copied (set RETOUCH_TOKEN)");
  } catch {
    area.select();
    toast("select and copy the command below");
  }
}

// ---- dashboard ---------------------------------------------------------------------------------

let dashboardTimer = null;

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
}

function cell(content, cls) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content);
  else td.textContent = content;
  if (cls) td.className = cls;
  return td;
}

function templatesCell(st) {
  const frag = document.createDocumentFragment();
  for (const [fn, tpls] of Object.entries((st && st.templates) || {})) {
    for (const [tid, t] of Object.entries(tpls)) {
      const span = document.createElement("span");
      span.className = "tpl";
      const dot = document.createElement("span");
      dot.className = t.host ? "dot" : "dot off";
      dot.textContent = "● ";
      span.append(dot, `${fn}/${tid.startsWith("upload:") ? tid.slice(0, 15) + "…" : tid} ${t.state}${t.bytes ? ` ${(t.bytes / 1e6).toFixed(1)} MB` : ""}`);
      frag.append(span);
    }
  }
  return frag;
}

async function refreshDashboard() {
  try {
    const doc = await api("/v1/executors");
    const q = doc.queue || {};
    $("d-queue").textContent = q.waiting ?? "–";
    $("d-admitted").textContent = q.admitted ?? "–";
    $("d-rejected").textContent = q.rejected ?? "–";
    const lat = doc.latency || {};
    $("d-latency").textContent = `${fmtSeconds(lat.p50_s)} / ${fmtSeconds(lat.p95_s)}`;
    $("d-invocations").textContent = String(lat.invocations ?? 0);
    const rows = doc.executors.map((e) => {
      const st = e.state || {};
      const engine = st.engine || {};
      const cache = st.cache || {};
      const tr = document.createElement("tr");
      tr.append(
        cell(e.name),
        cell(e.phase, `state-${e.phase}`),
        cell(e.device),
        cell([...(st.models || []), ...(st.loading || []).map((m) => `${m} (loading)`)].join(", ") || "–"),
        cell(`${e.inflight} / ${e.slots}`),
        cell(`${engine.running ?? 0} running · ${engine.ready ?? 0} ready`),
        cell(cache.host_budget_bytes ? `${(cache.host_bytes / 1e6).toFixed(0)} / ${(cache.host_budget_bytes / 1e6).toFixed(0)} MB` : "–"),
        cell(templatesCell(st)),
      );
      return tr;
    });
    $("executors").tBodies[0].replaceChildren(...rows);
    $("d-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("d-updated").textContent = `not updated: ${err.message}`;
  }
}

function showTab(name) {
  for (const tab of ["playground", "dashboard"]) {
    $(tab).hidden = tab !== name;
    $(`tab-${tab}`).classList.toggle("active", tab === name);
  }
  clearInterval(dashboardTimer);
  if (name === "dashboard") {
    refreshDashboard();
    dashboardTimer = setInterval(refreshDashboard, DASHBOARD_EVERY_MS);
  }
}

// ---- wiring ---------------------------------------------------------------------------------

function init() {
  takeTokenFromFragment();
  $("token").value = token();
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(TOKEN_KEY, $("token").value.trim());
    loadFunctions();
  });
  $("token-forget").addEventListener("click", () => {
    localStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    setLoginState("token removed");
  });
  $("tab-playground").addEventListener("click", () => showTab("playground"));
  $("tab-dashboard").addEventListener("click", () => showTab("dashboard"));
  $("function").addEventListener("change", () => chooseFunction().catch((e) => toast(e.message, true)));
  $("template").addEventListener("change", () => chooseTemplate().catch((e) => toast(e.message, true)));
  $("upload").addEventListener("change", (e) => chooseUpload(e.target.files[0]).catch((err) => toast(err.message, true)));
  const canvas = $("mask-canvas");
  canvas.addEventListener("pointerdown", onPointerDown);
  canvas.addEventListener("pointermove", onPointerMove);
  canvas.addEventListener("pointerup", onPointerUp);
  canvas.addEventListener("pointercancel", onPointerUp);
  $("brush").addEventListener("input", () => { $("brush-value").textContent = $("brush").value; });
  $("eraser").addEventListener("click", () => {
    mask.eraser = !mask.eraser;
    $("eraser").setAttribute("aria-pressed", String(mask.eraser));
  });
  $("undo").addEventListener("click", undoMask);
  $("clear").addEventListener("click", () => clearMask());
  $("invert").addEventListener("click", invertMask);
  document.addEventListener("keydown", (e) => {
    if ((e.ctrlKey || e.metaKey) && e.key === "z") { e.preventDefault(); undoMask(); }
  });
  $("random-seed").addEventListener("click", () => { $("seed").value = String(Math.floor(Math.random() * 2 ** 31)); });
  $("examples").addEventListener("change", () => { $("prompt").value = $("examples").value; });
  $("defaults").addEventListener("click", resetSettings);
  $("submit").addEventListener("click", () => submit().catch((e) => toast(e.message, true)));
  $("cancel").addEventListener("click", cancelJob);
  $("copy-curl").addEventListener("click", copyCurl);
  loadFunctions();
}

document.addEventListener("DOMContentLoaded", init);
