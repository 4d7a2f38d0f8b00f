// The narration fleet's web page: submit a text or a file, follow the job over server-sent events,
// listen while it renders (the progressive MP3 stream), jump between chapters, download the file,
// list and delete jobs. Plain ES module, no framework, no build step, nothing from another host.

const KEY_STORAGE = "narrate.apiKey";
const TERMINAL = new Set(["done", "failed", "cancelled"]);
const EVENT_TYPES = ["queued", "started", "segment", "progress", "runaway", "warning", "done", "failed", "cancelled"];
const STATUS_WORDS = {
  queued: "Queued",
  running: "Narrating",
  finalizing: "Finishing the file",
  done: "Done",
  failed: "Failed",
  cancelled: "Cancelled",
};
const PAGE_SIZE = 20;

const $ = (id) => document.getElementById(id);
const el = {
  pageError: $("page-error"),
  keyPanel: $("key-panel"), keyForm: $("key-form"), key: $("api-key"), forgetKey: $("forget-key"), keyStatus: $("key-status"),
  form: $("job-form"), textField: $("text-field"), text: $("text"), textError: $("text-error"),
  fileField: $("file-field"), file: $("file"), fileError: $("file-error"),
  title: $("title"), model: $("model"), modelHint: $("model-hint"), voice: $("voice"), format: $("format"),
  submit: $("submit"), formStatus: $("form-status"), formError: $("form-error"),
  job: $("job"), jobHeading: $("job-heading"), jobTitle: $("job-title"), jobStatus: $("job-status"), jobNote: $("job-note"),
  progress: $("progress"), percent: $("progress-percent"), progressText: $("progress-text"),
  announcer: $("announcer"), connection: $("connection"),
  player: $("player"), chapters: $("chapters"),
  downloads: $("downloads"), download: $("download"), captions: $("captions"),
  jobsHeading: $("jobs-heading"), refresh: $("refresh"), jobsStatus: $("jobs-status"), jobList: $("job-list"), more: $("more"),
};

// --- the API ----------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function storedKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return "";  // storage refused (private mode): no key
  }
}

async function problem(response) {
  try {
    const body = await response.json();
    if (typeof body.detail === "string") return body.detail;
    return JSON.stringify(body.detail ?? body);
  } catch {
    return `${response.status} ${response.statusText}`.trim();
  }
}

/** fetch with the API key as a Bearer header; the JSON answer, or an ApiError with the API's detail. */
async function api(path, { method = "GET", json, body } = {}) {
  const headers = new Headers({ Accept: "application/json" });
  const key = storedKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  if (json !== undefined) {
    headers.set("Content-Type", "application/json");
    body = JSON.stringify(json);
  }
  let response;
  try {
    response = await fetch(path, { method, headers, body });
  } catch {
    throw new ApiError(0, "The API cannot be reached. Check the connection and try again.");
  }
  if (!response.ok) {
    let message = await problem(response);
    if (response.status === 401) message = `${message} Enter an API key under “API key” at the top of the page.`;
    throw new ApiError(response.status, message);
  }
  return response.status === 204 ? null : response.json();
}

/** ``link`` (a path the API gave, maybe with ?token=) with ``name=value`` set in its query. */
function withParam(link, name, value) {
  const url = new URL(link, location.href);
  url.searchParams.set(name, String(value));
  return url.pathname + url.search;
}

/** The job's live stream: links.stream; before the API names it, the same path with the audio link's token. */
function streamLink(links) {
  if (links.stream) return links.stream;
  const url = new URL(`${links.self}/stream`, location.href);
  const token = new URL(links.audio, location.href).searchParams.get("token");
  if (token) url.searchParams.set("token", token);
  return url.pathname + url.search;
}

// --- small helpers ----------------------------------------------------------------------------------

function show(node, text) {
  node.textContent = text;
  node.hidden = !text;
}

function clock(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = String(s % 60).padStart(2, "0");
  return h ? `${h}:${String(m).padStart(2, "0")}:${r}` : `${m}:${r}`;
}

function percentOf(done, total) {
  return total > 0 ? Math.floor((100 * done) / total) : 0;  // 100 only once every segment is narrated
}

function reportError(error, where = el.pageError) {
  show(where, error instanceof ApiError || error instanceof Error ? error.message : String(error));
  if (error instanceof ApiError && error.status === 401) el.keyPanel.open = true;
}

// --- the API key ------------------------------------------------------------------------------------

el.key.value = storedKey();
el.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  try {
    const key = el.key.value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
    el.keyStatus.textContent = key ? "Key saved in this browser." : "No key: requests are sent without one.";
  } catch {
    el.keyStatus.textContent = "This browser does not let the page keep the key.";
  }
  show(el.pageError, "");
  loadModels();
  loadJobs();
});
el.forgetKey.addEventListener("click", () => {
  try {
    localStorage.removeItem(KEY_STORAGE);
  } catch { /* nothing kept */ }
  el.key.value = "";
  el.keyStatus.textContent = "Key forgotten.";
});

// --- models and voices ------------------------------------------------------------------------------

let models = [];

async function loadModels() {
  try {
    models = await api("v1/models");
  } catch (error) {
    reportError(error);
    return;
  }
  const previous = el.model.value;
  el.model.replaceChildren(
    ...models.map((m) => {
      const selected = previous ? m.name === previous : m.default;
      return new Option(m.ready ? m.name : `${m.name} (no workers running)`, m.name, selected, selected);
    }),
  );
  fillVoices();
}

function fillVoices() {
  const model = models.find((m) => m.name === el.model.value);
  if (!model) return;
  el.modelHint.textContent = model.description || "";
  el.voice.replaceChildren(
    ...model.voices.map((v) => new Option(v, v, v === model.default_voice, v === model.default_voice)),
  );
}

el.model.addEventListener("change", fillVoices);

// --- submitting -------------------------------------------------------------------------------------

function source() {
  return el.form.elements.source.value;
}

function showSource() {
  const file = source() === "file";
  el.textField.hidden = file;
  el.fileField.hidden = !file;
}

for (const radio of el.form.elements.source) radio.addEventListener("change", showSource);

function invalid(input, message, errorNode) {
  input.setAttribute("aria-invalid", "true");
  show(errorNode, message);
  input.focus();
}

function clearInvalid() {
  for (const [input, node] of [[el.text, el.textError], [el.file, el.fileError]]) {
    input.removeAttribute("aria-invalid");
    show(node, "");
  }
  show(el.formError, "");
}

let submitting = false;

el.form.addEventListener("submit", async (event) => {
  event.preventDefault();
  if (submitting) return;  // (the button stays focusable: disabling it would drop the keyboard's focus)
  clearInvalid();
  const fields = { model: el.model.value, voice: el.voice.value, format: el.format.value };
  const title = el.title.value.trim();
  if (title) fields.title = title;
  let request;
  if (source() === "file") {
    const file = el.file.files[0];
    if (!file) return invalid(el.file, "Choose a file to narrate (an EPUB, .txt or .md file).", el.fileError);
    const form = new FormData();
    form.append("file", file, file.name);
    for (const [name, value] of Object.entries(fields)) if (value) form.append(name, value);
    request = { method: "POST", body: form };
  } else {
    const text = el.text.value;
    if (!text.trim()) return invalid(el.text, "Paste the text to narrate.", el.textError);
    for (const name of ["model", "voice"]) if (!fields[name]) delete fields[name];
    request = { method: "POST", json: { text, ...fields } };
  }
  submitting = true;
  el.submit.setAttribute("aria-disabled", "true");
  el.formStatus.textContent = "Sending…";
  try {
    const accepted = await api("v1/jobs", request);
    el.formStatus.textContent = "Accepted: narrating it now.";
    const view = await api(accepted.links.self).catch(() => ({ ...accepted, title, format: fields.format }));
    openJob(view, { focus: true });
    loadJobs();
  } catch (error) {
    el.formStatus.textContent = "";
    reportError(error, el.formError);
  } finally {
    submitting = false;
    el.submit.removeAttribute("aria-disabled");
  }
});

// --- the job: progress, listening, chapters, downloads ------------------------------------------------

let current = null;

/** When a signed link's token runs out (ms since the epoch), or Infinity for a link without one. */
function expiryOf(link) {
  const token = link ? new URL(link, location.href).searchParams.get("token") : null;
  const seconds = Number(token?.split(".")[0]);
  return token && seconds > 0 ? seconds * 1000 : Infinity;
}

/** Signed links run out (NARRATE_LINK_TTL_S, an hour): a minute before they do, ask for the job
 * again and put the new ones where the old are (the download, the captions, a file in a paused
 * player). A job done an hour after it was opened, or a tab left open, would get 401s. */
/** The job read again, its links replaced by the new ones; null if another job was opened meanwhile. */
async function reread(job) {
  const view = await api(job.links.self);
  if (job !== current) return null;
  job.links = { ...job.links, ...view.links };
  return view;
}

function renewLinks(job, { soonest = 1000 } = {}) {
  clearTimeout(job.renewTimer);
  const expiry = Math.min(expiryOf(job.links.audio), expiryOf(job.links.events));
  if (expiry === Infinity) return;
  job.renewTimer = setTimeout(async () => {
    if (job !== current) return;
    try {
      if (!await reread(job)) return;
      if (!el.downloads.hidden) showDownloads(job);
      if (job.playing === "file" && el.player.paused) {
        const at = el.player.currentTime;
        el.player.src = job.links.audio;
        if (at) el.player.addEventListener("loadedmetadata", () => { el.player.currentTime = at; }, { once: true });
      }
    } catch {
      renewLinks(job, { soonest: 30_000 });  // the API away: the old links, and a try now and then
      return;
    }
    renewLinks(job);
  }, Math.max(expiry - Date.now() - 60_000, soonest));
}

function closeJob() {
  if (!current) return;
  current.events?.close();
  clearTimeout(current.retryTimer);
  clearTimeout(current.renewTimer);
  current = null;
  el.player.pause();
  el.player.removeAttribute("src");
  el.player.load();
  el.job.hidden = true;
}

function openJob(view, { focus = false } = {}) {
  closeJob();
  current = {
    id: view.id,
    links: view.links,
    format: view.format,
    status: view.status,
    done: view.segments_done ?? 0,
    total: view.segments_total ?? 0,
    audioSeconds: view.audio_seconds ?? 0,
    chapters: Math.max(1, view.chapters ?? 1),
    titles: [],
    starts: null,  // chapter start times in the finished file, once it is done
    playing: null,  // "stream" (from chapter streamChapter) or "file"
    streamChapter: 1,
    lastEventId: "",
    announced: Math.floor(percentOf(view.segments_done ?? 0, view.segments_total ?? 0) / 25),
    retries: 0,
  };
  el.job.hidden = false;
  el.jobTitle.textContent = view.title || "Untitled";
  show(el.connection, "");
  el.downloads.hidden = true;
  history.replaceState(null, "", `#job=${encodeURIComponent(view.id)}`);
  renewLinks(current);
  renderChapters();
  setStatus(view.status, view.error);
  renderProgress();
  if (view.status === "done") {
    finished({ announce: false });
  } else if (!TERMINAL.has(view.status)) {
    useStream(1, { play: false });  // preload="none": nothing is fetched before play
    follow();
  }
  if (focus) el.jobHeading.focus();
}

function setStatus(status, error) {
  current.status = status;
  el.jobStatus.textContent = STATUS_WORDS[status] || status;
  el.jobStatus.dataset.status = status;
  el.jobNote.textContent = error ? `: ${error}` : "";
  updateListItem(current);
}

function renderProgress(eta) {
  const { done, total, audioSeconds } = current;
  const pct = current.status === "done" ? 100 : percentOf(done, total);
  el.progress.value = pct;
  el.percent.textContent = `${pct} %`;
  let text = `${done} of ${total} sentences narrated`;
  if (audioSeconds) text += `, ${clock(audioSeconds)} of audio`;
  if (eta != null && done < total) text += `, about ${clock(eta)} left`;
  if (current.status === "done" || (done === total && total > 0 && current.status !== "failed")) {
    text = `${total} of ${total} sentences narrated${audioSeconds ? `, ${clock(audioSeconds)} of audio` : ""}`;
  }
  el.progressText.textContent = text;
  updateListItem(current);
  // the live region speaks at every quarter, not at every sentence
  const step = Math.floor(pct / 25);
  if (step > current.announced) {
    current.announced = step;
    if (pct < 100) announce(`${pct} % narrated.`);
  }
}

function announce(text) {
  el.announcer.textContent = text;
}

function follow() {
  const job = current;
  let url = job.links.events;
  if (job.lastEventId) url = withParam(url, "after", job.lastEventId);
  const events = new EventSource(url);
  job.events = events;
  for (const type of EVENT_TYPES) events.addEventListener(type, (event) => onEvent(job, type, event));
  events.addEventListener("open", () => {
    if (job !== current) return;
    job.retries = 0;
    show(el.connection, "");
  });
  events.addEventListener("error", (event) => {
    if (job !== current) return events.close();
    // an "error" event from the API (its feed failed) or a lost connection: EventSource reconnects
    // by itself with Last-Event-ID; a refused reconnect (an expired link, a deleted job) closes it
    if (events.readyState === EventSource.CLOSED) return recover(job);
    show(el.connection, event.data ? "The event stream failed; resuming…" : "Connection lost; reconnecting…");
  });
}

/** The event stream was closed for good: ask for the job again (fresh links) and resume after the last event. */
async function recover(job) {
  job.events?.close();
  if (job.retries >= 5) {
    show(el.connection, "Live progress stopped. Open the job again from the list to resume.");
    return;
  }
  const wait = 1000 * 2 ** job.retries++;
  show(el.connection, "Connection lost; reconnecting…");
  job.retryTimer = setTimeout(async () => {
    if (job !== current) return;
    try {
      const view = await reread(job);
      if (!view) return;
      renewLinks(job);
      if (view.status === "done" || TERMINAL.has(view.status)) {
        setStatus(view.status, view.error);
        job.done = view.segments_done;
        job.total = view.segments_total;
        job.audioSeconds = view.audio_seconds;
        renderProgress();
        show(el.connection, "");
        if (view.status === "done") finished();
        loadJobs();
        return;
      }
      follow();
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) {
        setStatus("cancelled", "this job no longer exists");
        show(el.connection, "");
      } else {
        recover(job);
      }
    }
  }, wait);
}

function onEvent(job, type, event) {
  if (job !== current) return;
  if (event.lastEventId) job.lastEventId = event.lastEventId;
  let data = {};
  try {
    data = JSON.parse(event.data || "{}");
  } catch { /* an event without data */ }
  switch (type) {
    case "queued":
      job.total = data.segments ?? job.total;
      if (data.chapters && data.chapters !== job.chapters) {
        job.chapters = data.chapters;
        renderChapters();
      }
      renderProgress();
      break;
    case "started":
      if (job.status === "queued") setStatus("running");
      break;
    case "segment":
    case "progress":
      if (job.status === "queued") setStatus("running");
      job.done = Math.max(job.done, data.done ?? 0);
      job.total = data.total ?? job.total;
      if (data.audio_seconds != null) job.audioSeconds = data.audio_seconds;  // progress events say it
      if (job.done >= job.total && job.status === "running") {
        setStatus("finalizing");
        announce("100 % narrated. Finishing the file…");
      }
      renderProgress(data.eta_s);
      break;
    case "warning":
      el.jobNote.textContent = " (some sentences may sound wrong: see the job's manifest)";
      break;
    case "done":
      job.events.close();
      job.done = job.total;
      if (data.duration_s) job.audioSeconds = data.duration_s;
      setStatus("done");
      renderProgress();
      finished();
      loadJobs();
      break;
    case "failed":
    case "cancelled":
      job.events.close();
      setStatus(type, data.error);
      announce(type === "failed" ? `The job failed: ${data.error || "no reason given"}.` : "The job was cancelled.");
      loadJobs();
      break;
    default:
      break;
  }
}

function renderChapters() {
  const items = [];
  for (let n = 1; n <= current.chapters; n++) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "chapter";
    button.dataset.chapter = String(n);
    const title = current.titles[n - 1];
    button.textContent = title ? `${n}. ${title}` : `Chapter ${n}`;
    button.addEventListener("click", () => jumpTo(n));
    const item = document.createElement("li");
    item.append(button);
    items.push(item);
  }
  el.chapters.replaceChildren(...items);
  markChapter(current.playing === "stream" ? current.streamChapter : chapterAt(el.player.currentTime));
}

function markChapter(n) {
  for (const button of el.chapters.querySelectorAll("button")) {
    if (Number(button.dataset.chapter) === n) button.setAttribute("aria-current", "true");
    else button.removeAttribute("aria-current");
  }
}

function chapterAt(seconds) {
  if (!current?.starts) return 1;
  let n = 1;
  current.starts.forEach((start, i) => {
    if (seconds + 0.05 >= start) n = i + 1;
  });
  return n;
}

function play() {
  el.player.play().catch(() => { /* the browser wants a gesture first: the controls are there */ });
}

function useStream(chapter, { play: start = true } = {}) {
  current.playing = "stream";
  current.streamChapter = chapter;
  const link = streamLink(current.links);
  el.player.src = chapter > 1 ? withParam(link, "chapter", chapter) : link;
  markChapter(chapter);
  if (start) play();
}

function jumpTo(n) {
  if (current.playing === "file" && current.starts) {
    el.player.currentTime = current.starts[n - 1] ?? 0;
    markChapter(n);
    play();
  } else {
    useStream(n);
  }
}

function canPlayFile() {
  const types = { mp3: "audio/mpeg", wav: "audio/wav", flac: "audio/flac", opus: 'audio/ogg; codecs="opus"' };
  return el.player.canPlayType(types[current.format] || "audio/mp4") !== "";
}

/** The job is done: the download links, the chapters' titles and times, and the finished file in the
 * player (seekable) unless the stream is playing now. */
function showDownloads(job) {
  el.download.href = job.links.audio;
  el.download.textContent = `Download the audiobook (${(job.format || "").toUpperCase()})`;
  el.captions.href = withParam(job.links.captions || `${job.links.self}/captions`, "format", "vtt");
  el.downloads.hidden = false;
}

async function finished({ announce: say = true } = {}) {
  const job = current;
  showDownloads(job);
  if (say) announce("Done: the audiobook is ready to download.");
  try {
    const vtt = await fetchText(withParam(job.links.captions || `${job.links.self}/captions`, "kind", "chapters"));
    if (job !== current) return;
    const cues = parseChapters(vtt);
    if (cues.length) {
      job.titles = cues.map((c) => c.title);
      job.starts = cues.map((c) => c.start);
      job.chapters = cues.length;
    }
  } catch { /* no titles: "Chapter N" stays */ }
  if (job !== current) return;
  const streaming = job.playing === "stream" && !el.player.paused && !el.player.ended;
  if (!streaming && canPlayFile()) {
    // where the stream was paused, in the file's time: the chapter's start plus what was heard of it
    const offset = job.playing === "stream" && el.player.currentTime > 0
      ? (job.starts?.[job.streamChapter - 1] ?? 0) + el.player.currentTime : 0;
    job.playing = "file";
    el.player.src = job.links.audio;
    if (offset) el.player.addEventListener("loadedmetadata", () => { el.player.currentTime = offset; }, { once: true });
  }
  renderChapters();
}

async function fetchText(path) {
  const headers = new Headers();
  const key = storedKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { headers });
  if (!response.ok) throw new ApiError(response.status, await problem(response));
  return response.text();
}

/** A WebVTT chapters track (GET .../captions?kind=chapters): each cue's start and title. */
function parseChapters(vtt) {
  const seconds = (t) => t.split(":").reduce((sum, part) => sum * 60 + Number(part), 0);
  const cues = [];
  for (const block of vtt.replace(/\r/g, "").split(/\n\n+/)) {
    const lines = block.split("\n");
    const at = lines.findIndex((line) => line.includes("-->"));
    if (at < 0) continue;
    const start = seconds(lines[at].split("-->")[0].trim());
    // cue text is WebVTT markup: the server escapes & < > (jobs/captions.py), "&amp;" is "&"
    const title = lines.slice(at + 1).join(" ").trim().replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
    cues.push({ start, title });
  }
  return cues;
}

el.player.addEventListener("ended", () => {
  // the live stream was heard to its end: from now on the finished file, which can seek
  if (current?.status === "done" && current.playing === "stream" && canPlayFile()) {
    current.playing = "file";
    el.player.src = current.links.audio;
    markChapter(1);
  }
});
el.player.addEventListener("timeupdate", () => {
  if (current?.playing === "file") markChapter(chapterAt(el.player.currentTime));
});
el.player.addEventListener("error", () => {
  if (!current || !el.player.getAttribute("src")) return;
  show(el.connection, current.playing === "stream"
    ? "The live audio could not be played; try again in a moment."
    : "The audio file could not be played in this browser; download it instead.");
});

// --- the job list -----------------------------------------------------------------------------------

let cursor = null;
const listed = new Map();  // job id -> its list entry's view (the current job's is kept up to date)

function statusLine(job) {
  const parts = [STATUS_WORDS[job.status] || job.status];
  if (!TERMINAL.has(job.status)) parts.push(`${percentOf(job.segments_done, job.segments_total)} %`);
  if (job.status === "done" && job.duration_s) parts.push(clock(job.duration_s));
  parts.push(job.format, new Date(job.created_at * 1000).toLocaleString());
  return parts.join(" · ");
}

function jobItem(job) {
  const item = document.createElement("li");
  item.className = "job-item";
  item.dataset.id = job.id;
  const title = job.title || "Untitled";
  const info = document.createElement("div");
  info.className = "job-info";
  const name = document.createElement("span");
  name.className = "job-name";
  name.id = `job-${job.id}-name`;
  name.textContent = title;
  const meta = document.createElement("span");
  meta.className = "job-meta";
  meta.textContent = statusLine(job);
  info.append(name, meta);
  listed.set(job.id, { job, meta });
  const open = document.createElement("button");
  open.type = "button";
  open.className = "secondary";
  open.textContent = "Open";
  open.setAttribute("aria-describedby", name.id);
  open.addEventListener("click", () => openFromList(job.id));
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "danger";
  remove.textContent = "Delete";
  remove.setAttribute("aria-describedby", name.id);
  remove.addEventListener("click", () => deleteJob(job.id, title, item));
  const actions = document.createElement("div");
  actions.className = "job-actions";
  actions.append(open, remove);
  item.append(info, actions);
  return item;
}

async function loadJobs({ append = false, note = "" } = {}) {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (append && cursor) query.set("cursor", cursor);
  let page;
  try {
    page = await api(`v1/jobs?${query}`);
  } catch (error) {
    el.jobsStatus.textContent = "";
    reportError(error);
    return;
  }
  cursor = page.next_cursor;
  if (!append) listed.clear();
  const items = page.jobs.map(jobItem);
  if (append) el.jobList.append(...items);
  else el.jobList.replaceChildren(...items);
  el.more.hidden = !cursor;
  el.jobsStatus.textContent = [note, el.jobList.children.length ? "" : "No jobs yet."].filter(Boolean).join(" ");
}

function updateListItem(job) {
  const entry = listed.get(job.id);
  if (!entry) return;
  Object.assign(entry.job, { status: job.status, segments_done: job.done, segments_total: job.total });
  entry.meta.textContent = statusLine(entry.job);
}

async function openFromList(id, { focus = true } = {}) {
  try {
    openJob(await api(`v1/jobs/${encodeURIComponent(id)}`), { focus });
  } catch (error) {
    reportError(error);
    if (error instanceof ApiError && error.status === 404) loadJobs();
  }
}

async function deleteJob(id, title, item) {
  if (!confirm(`Delete “${title}”? A job still narrating is cancelled; its audio is deleted.`)) return;
  try {
    await api(`v1/jobs/${encodeURIComponent(id)}`, { method: "DELETE" });
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 404)) return reportError(error);
  }
  if (current?.id === id) {
    closeJob();
    history.replaceState(null, "", location.pathname + location.search);
  }
  // keep the keyboard where it was: on the next job's Delete button, else on the list's heading
  const next = item.nextElementSibling || item.previousElementSibling;
  item.remove();
  listed.delete(id);
  const note = `Deleted “${title}”.`;
  el.jobsStatus.textContent = note;
  (next?.querySelector(".danger") || el.jobsHeading).focus();
  if (!el.jobList.children.length) loadJobs({ note });  // older jobs, if there are more
}

el.refresh.addEventListener("click", () => {
  el.jobsStatus.textContent = "Refreshing…";
  loadJobs();
});
el.more.addEventListener("click", () => loadJobs({ append: true }));

// --- start ------------------------------------------------------------------------------------------

showSource();
loadModels();
loadJobs();
const wanted = new URLSearchParams(location.hash.slice(1)).get("job");
if (wanted) openFromList(wanted, { focus: false });  // a reload reopens the job it showed
