// The vlmserve playground: chat with a served model about pictures, streamed, from this server's own API.
// Every model the server lists is shown with its status; choosing one that is not loaded loads it.
// No build step and nothing fetched from elsewhere. The API key, when the server wants one, is asked
// for once and kept in this tab's sessionStorage.

const $ = (id) => document.getElementById(id);
const WEATHER_TOOL = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the current weather in a city.",
    parameters: {
      type: "object",
      properties: {
        location: { type: "string", description: "The city name." },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      },
      required: ["location"],
    },
  },
};

const REFRESH_MS = 5000;      // how often the models' statuses are read again while the page is visible
const STATUSES = ["loaded", "loading", "available", "unavailable", "failed"];  // as /v1/models says them
const UNUSABLE = ["unavailable", "failed"];  // listed, with the reason as the option's title, not chosen

const history = [];          // OpenAI chat messages sent so far
let attached = [];           // data URLs of the images for the next message
let running = null;          // the AbortController of the request in flight
let models = [];             // the models as /v1/models last listed them
let newestList = 0;          // the newest /v1/models asked for: an older answer that comes after it is not drawn
let refreshing = null;       // the interval that keeps the statuses fresh, once the list could be read

function headers() {
  const key = sessionStorage.getItem("vlmserve-api-key");
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function status(text) { $("status").textContent = text; }

// -- models: listed with their status, loaded when chosen ----------------------------------

// The server's models, drawn into the list; null where the server wants an API key this tab lacks.
async function listModels() {
  const asked = ++newestList;
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) return null;
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  const list = (await response.json()).data;
  if (asked === newestList) showModels(list);
  return list;
}

async function loadModels() {
  const list = await listModels();
  if (list === null) {
    $("key-form").hidden = false;
    $("api-key").focus();
    status("This server needs an API key.");
    return false;
  }
  $("key-form").hidden = true;
  status(summary(list));
  refreshing ??= setInterval(refresh, REFRESH_MS);
  return true;
}

// "2 loaded, 3 available": the models counted by status.
function summary(list) {
  const counts = STATUSES.map((name) => [name, list.filter((m) => m.status === name).length]);
  return counts.filter(([, n]) => n).map(([name, n]) => `${n} ${name}`).join(", ") || "This server lists no models.";
}

// The options are kept (updated in place) while the same models are listed, so an open list is not reset.
function showModels(list) {
  models = list;
  const select = $("model");
  const same = list.length === select.options.length && list.every((m, i) => select.options[i].value === m.id);
  const chosen = select.value;
  if (!same) select.replaceChildren(...list.map((m) => new Option(m.id, m.id)));
  list.forEach((m, i) => describe(select.options[i], m));
  if (!same) select.value = pick(list, chosen);
}

function describe(option, model) {
  option.textContent = `${model.id} (${model.status})`;
  option.disabled = UNUSABLE.includes(model.status);
  option.title = model.reason || "";
}

// The model chosen before if it can still be, else the first loaded one, else the first that can load.
function pick(list, chosen) {
  const usable = list.filter((m) => !UNUSABLE.includes(m.status));
  const model = usable.find((m) => m.id === chosen) || usable.find((m) => m.status === "loaded") || usable[0];
  return model ? model.id : "";
}

async function refresh() {
  if (document.hidden) return;
  try {
    await listModels();
  } catch { /* the server is away for now: the next refresh tries again */ }
}

// A chat to a model that is still loading waits for it on the server; the load is asked for here so
// that its progress shows.
async function load(id) {
  status(`loading ${id}…`);
  describe($("model").selectedOptions[0], { id, status: "loading" });
  const started = performance.now();
  try {
    const response = await fetch("/v1/models/load", {
      method: "POST", headers: headers(), body: JSON.stringify({ model: id }),
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `${id} did not load: HTTP ${response.status}`);
    }
    status(`${id} loaded in ${((performance.now() - started) / 1000).toFixed(1)} s`);
  } catch (error) {
    status(error instanceof TypeError ? `Cannot reach the server: ${error.message}` : error.message);
  }
  await listModels().catch(() => {});
}

$("model").addEventListener("change", () => {
  const model = models.find((m) => m.id === $("model").value);
  if (model && model.status !== "loaded") load(model.id);
});
document.addEventListener("visibilitychange", () => { if (refreshing !== null) refresh(); });

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem("vlmserve-api-key", $("api-key").value);
  if (!(await loadModels())) {
    sessionStorage.removeItem("vlmserve-api-key");
    $("key-error").textContent = "That key was refused.";
  } else {
    $("key-error").textContent = "";
  }
});

// -- images: choose, drop, paste ---------------------------------------------------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const file of files) {
    if (file.type.startsWith("image/")) attached.push(await readAsDataURL(file));
  }
  drawThumbs();
}

function drawThumbs() {
  $("thumbs").replaceChildren(...attached.map((url, i) => {
    const item = document.createElement("li");
    const img = document.createElement("img");
    img.src = url;
    img.alt = `attached image ${i + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "Remove";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.onclick = () => { attached.splice(i, 1); drawThumbs(); };
    item.append(img, remove);
    return item;
  }));
}

$("images").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
$("drop").addEventListener("dragover", (e) => { e.preventDefault(); $("drop").classList.add("over"); });
$("drop").addEventListener("dragleave", () => $("drop").classList.remove("over"));
$("drop").addEventListener("drop", (e) => {
  e.preventDefault();
  $("drop").classList.remove("over");
  attach(e.dataTransfer.files);
});
document.addEventListener("paste", (e) => attach([...e.clipboardData.files]));

// -- chat ----------------------------------------------------------------------------------

function bubble(role, text = "", images = []) {
  const item = document.createElement("li");
  item.className = role;
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "sent image";
    item.append(img);
  }
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;
  item.append(span);
  $("chat").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

function showCalls(item, calls) {
  for (const call of calls) {
    if (!call) continue;
    const block = document.createElement("div");
    block.className = "tool-call";
    block.textContent = `tool call: ${call.function.name}(${call.function.arguments})`;
    item.append(block);
  }
}

async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  const content = [...attached.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
  bubble("user", text, attached);
  history.push({ role: "user", content });
  attached = [];
  drawThumbs();
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    // A weather call is answered here (the playground's made-up weather) and the model goes on: at
    // most a few rounds, so a model that only ever calls tools cannot loop for ever.
    for (let round = 0; round < 3; round++) {
      const calls = await reply(round === 0);
      const weather = calls.filter((call) => call.function.name === WEATHER_TOOL.function.name);
      if (!weather.length || weather.length < calls.length) break;
      for (const call of weather) {
        const result = JSON.stringify(madeUpWeather(call.function.arguments));
        history.push({ role: "tool", tool_call_id: call.id, content: result });
        const block = document.createElement("div");
        block.className = "tool-result";
        block.textContent = `tool result (made up by the playground): ${result}`;
        $("chat").lastElementChild.append(block);
      }
    }
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// The weather the playground's get_weather returns: made up, the same for the same city.
function madeUpWeather(argumentsJson) {
  let args = {};
  try { args = JSON.parse(argumentsJson); } catch { /* the model's arguments as they came */ }
  const city = String(args.location || "nowhere");
  let hash = 0;
  for (const ch of city) hash = (hash * 31 + ch.codePointAt(0)) % 1000;
  const unit = args.unit === "fahrenheit" ? "fahrenheit" : "celsius";
  const celsius = hash % 35;
  return { location: city, temperature: unit === "celsius" ? celsius : Math.round(celsius * 9 / 5 + 32), unit };
}

// One assistant reply, streamed into a new bubble; returns its tool calls (none: an answer).
async function reply(userTurnIsLast) {
  const item = bubble("assistant");
  const out = item.querySelector(".text");
  const body = {
    model: $("model").value, messages: history, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if ($("weather").checked) body.tools = [WEATHER_TOOL];
  const started = performance.now();
  let firstToken = null;
  let answer = "";
  const calls = [];
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    for await (const data of sse(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        const ttft = firstToken === null ? "-" : `${Math.round(firstToken - started)} ms`;
        $("usage").textContent = `prompt ${chunk.usage.prompt_tokens} tokens, completion `
          + `${chunk.usage.completion_tokens} tokens, time to first token ${ttft}`;
      }
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      if ((delta.content || delta.tool_calls) && firstToken === null) firstToken = performance.now();
      if (delta.content) { answer += delta.content; out.textContent = answer; }
      for (const entry of delta.tool_calls || []) {
        if (entry.id) calls[entry.index] = { id: entry.id, type: "function", function: { name: entry.function.name, arguments: "" } };
        if (entry.function?.arguments) calls[entry.index].function.arguments += entry.function.arguments;
      }
    }
    const made = calls.filter(Boolean);
    showCalls(item, made);
    history.push(made.length ? { role: "assistant", content: answer || null, tool_calls: made }
                             : { role: "assistant", content: answer });
    return made;
  } catch (error) {
    if (error.name === "AbortError") {
      out.textContent = answer + " [stopped]";
      history.push({ role: "assistant", content: answer });
    } else {
      item.classList.add("error");
      out.textContent = `Error: ${error.message}`;
      if (userTurnIsLast) history.pop();  // the user turn failed; it is not part of the conversation
    }
    return [];
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => running?.abort());   // closing the stream aborts it on the server
$("clear").addEventListener("click", () => { history.length = 0; $("chat").replaceChildren(); $("usage").textContent = ""; });

loadModels().catch((error) => status(`Cannot reach the server: ${error.message}`));
