// vramcast web page: a job spec form whose every number comes from the REST API.
// The form's state lives in the URL; charts are plain SVG drawn from API answers.
"use strict";

(() => {
  const GIB = 1024 ** 3;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const API = {
    estimate: "v1/estimates",
    batch: "v1/estimates:batch",
    fitCheck: "v1/fit-checks",
    models: "v1/models",
    gpus: "v1/gpus",
  };
  const DEBOUNCE_MS = 250;
  // The API's bounds (openapi/openapi.json): the curves never ask beyond them.
  const MAX_BATCH_SIZE = 4096;
  const MAX_SEQ_LEN = 1048576;
  const PREFERRED_MODEL = "meta-llama/Llama-3.1-8B";
  const PREFERRED_GPUS = ["RTX4090", "A100-80GB", "H100-SXM"];
  // A GPU given by the total memory nvidia-smi reports, in MiB; the API matches it by size.
  const MEMORY_GPU = /^([1-9][0-9]{0,6})MiB$/;

  // Form state: every field, its default, and how it reads from/writes to the URL.
  const DEFAULTS = {
    source: "catalog",
    model: "",
    config: "",
    method: "lora",
    lora_r: 8,
    lora_alpha: 8,
    target_modules: "",
    num_virtual_tokens: 20,
    objective: "sft",
    max_completion_length: "",
    precompute_ref_log_probs: false,
    quant_type: "nf4",
    quant_bits: "",
    group_size: "",
    double_quant: false,
    compute_dtype: "",
    prepare_kbit: true,
    batch_size: 4,
    seq_len: 2048,
    gradient_accumulation_steps: 1,
    dtype: "bf16",
    optim: "adamw_torch_fused",
    attn_implementation: "sdpa",
    loss: "",
    framework: "hf",
    gradient_checkpointing: false,
    packing: false,
    liger_kernel: false,
    gpu_count: 1,
    strategy: "ddp",
    offload: "none",
    max_gpus: 1,
    gpus_per_node: 8,
    strategies: "fsdp,zero3",
  };
  const INTEGER_FIELDS = new Set([
    "lora_r", "lora_alpha", "batch_size", "seq_len", "gradient_accumulation_steps", "gpu_count",
    "max_gpus", "gpus_per_node", "num_virtual_tokens", "max_completion_length", "quant_bits",
    "group_size",
  ]);
  // Checkbox groups kept in the state (and the link) as their checked values, comma-separated.
  const LIST_FIELDS = new Set(["strategies"]);
  const BOOLEAN_FIELDS = new Set([
    "double_quant", "prepare_kbit", "gradient_checkpointing", "packing", "liger_kernel",
    "precompute_ref_log_probs",
  ]);

  // More options: the job's fields the form above does not lay out, built from the API's own
  // schema (JobSpec in /openapi.json), so a field the API gains appears there by itself. The
  // fields and sections the form lays out by hand:
  const OPENAPI = "openapi.json";
  const HAND_LAID = new Set([
    "model", "method", "objective", "dpo", "kto", "grpo", "orpo", "lora", "quantization", "ia3",
    "ln_tuning", "prompt_tuning", "prefix_tuning", "vera", "loha", "lokr", "adalora", "oft",
    "boft", "batch_size", "seq_len", "gradient_accumulation_steps", "dtype", "optim",
    "attn_implementation", "loss", "framework", "gradient_checkpointing", "packing",
    "liger_kernel", "gpu", "parallel.gpus", "parallel.strategy", "parallel.offload",
  ]);
  // The sections whose fields are offered one by one (the job's own fields come first).
  const MORE_SECTIONS = ["parallel", "vision", "allocator"];

  const COMPONENT_STYLE = {
    frozen_weights: { label: "Frozen weights", color: "#4b5563" },
    trainable_params: { label: "Trainable parameters", color: "#1d4ed8" },
    gradients: { label: "Gradients", color: "#b45309" },
    optimizer_state: { label: "Optimizer state", color: "#047857" },
    optimizer_temporaries: { label: "Optimizer temporaries", color: "#4d7c0f" },
    communication: { label: "Gathered parameters and buckets", color: "#be185d" },
    reference_model: { label: "Reference model (DPO)", color: "#0f766e" },
    activations: { label: "Activations", color: "#7c3aed" },
    recompute: { label: "Recompute", color: "#a21caf" },
    logits_loss: { label: "Logits and loss", color: "#be123c" },
    backward_temporaries: { label: "Backward temporaries", color: "#c2410c" },
    inputs: { label: "Inputs", color: "#0e7490" },
  };
  const OVERHEAD_STYLE = {
    allocator: { label: "Allocator cache (reserved − allocated)", color: "#334155" },
    cuda_context: { label: "CUDA context", color: "#57534e" },
    outside_allocator: { label: "Outside the allocator (NCCL, paged, cuBLAS)", color: "#78716c" },
  };
  const GPU_COLORS = ["#b91c1c", "#1d4ed8", "#047857", "#7c3aed", "#b45309", "#0e7490", "#a21caf"];

  // The result tables' columns: heading, and whether it holds numbers.
  const TABLE_COLUMNS = {
    "fit-table": [
      ["GPU"], ["Fits"], ["Usable GiB", true], ["Headroom GiB", true], ["Max batch", true],
      ["Max seq", true], ["Cost / h", true],
    ],
    "placement-table": [
      ["GPU"], ["Strategy"], ["GPUs", true], ["Nodes", true], ["GiB per GPU", true],
      ["Cost / h", true],
    ],
  };

  const $ = (id) => document.getElementById(id);
  const form = $("spec-form");
  const resultsEl = $("results");

  const page = {
    state: { ...DEFAULTS, gpus: [], more: {} },
    models: [],
    more: [], // the More options' fields, from the schema
    moreByPath: new Map(),
    gpus: [],
    modelDetails: new Map(),
    generation: 0,
    controller: null,
    timer: null,
    last: null, // the latest answers, for redrawing on resize
  };

  // ------------------------------------------------------------------------------------------
  // Formatting (units only here: the API answers in bytes)

  function gib(bytes) {
    return (bytes / GIB).toFixed(2);
  }

  function gibText(bytes) {
    return bytes > 0 && bytes < GIB / 200 ? "< 0.01 GiB" : `${gib(bytes)} GiB`;
  }

  function signedGib(bytes) {
    return bytes < 0 ? `−${gib(-bytes)}` : `+${gib(bytes)}`;
  }

  function countText(n) {
    if (n >= 1e9) return `${(n / 1e9).toFixed(2)} B`;
    if (n >= 1e6) return `${(n / 1e6).toFixed(1)} M`;
    if (n >= 1e3) return `${(n / 1e3).toFixed(1)} k`;
    return String(n);
  }

  function tokensText(n) {
    if (n >= 1024 && n % 1024 === 0) return `${n / 1024}k`;
    return String(n);
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  function svg(tag, attrs = {}, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ------------------------------------------------------------------------------------------
  // State <-> URL

  function stateFromUrl(search) {
    const params = new URLSearchParams(search);
    const state = { ...DEFAULTS, gpus: null };
    for (const key of Object.keys(DEFAULTS)) {
      if (!params.has(key)) continue;
      const raw = params.get(key);
      if (INTEGER_FIELDS.has(key)) {
        const n = Number.parseInt(raw, 10);
        if (Number.isFinite(n)) state[key] = n;
      } else if (BOOLEAN_FIELDS.has(key)) {
        state[key] = raw === "1" || raw === "true";
      } else {
        state[key] = raw;
      }
    }
    state.more = {};
    for (const [key, raw] of params) {
      if (page.moreByPath.has(key)) state.more[key] = raw;
    }
    if (params.has("gpu")) {
      state.gpus = params
        .getAll("gpu")
        .filter((v) => v)
        .map((v) => {
          const at = v.lastIndexOf("@");
          return gpuEntry(at < 0 ? v : v.slice(0, at), at < 0 ? "" : v.slice(at + 1));
        });
    }
    return state;
  }

  // A chosen GPU: a catalog name, or a memory total written as in the link ("24564MiB").
  function gpuEntry(name, price) {
    const size = MEMORY_GPU.exec(name);
    return size ? { name, memory_mib: Number.parseInt(size[1], 10), price } : { name, price };
  }

  function urlFromState(state) {
    const params = new URLSearchParams();
    for (const [key, def] of Object.entries(DEFAULTS)) {
      const value = state[key];
      if (value === def) continue;
      if (key === "config" && state.source !== "config") continue;
      if (key === "model" && state.source === "config") continue;
      params.set(key, BOOLEAN_FIELDS.has(key) ? (value ? "1" : "0") : String(value));
    }
    for (const field of page.more) {
      const raw = state.more[field.path];
      if (raw !== undefined) params.set(field.path, raw);
    }
    if (state.gpus.length === 0) params.append("gpu", "");
    for (const gpu of state.gpus) params.append("gpu", gpu.price ? `${gpu.name}@${gpu.price}` : gpu.name);
    const query = params.toString();
    return `${location.pathname}${query ? `?${query}` : ""}`;
  }

  // ------------------------------------------------------------------------------------------
  // State <-> form

  function writeForm(state) {
    form.elements.model_source.value = state.source;
    for (const key of Object.keys(DEFAULTS)) {
      if (key === "source" || key === "model") continue;
      const input = form.elements[key];
      if (!input) continue;
      if (LIST_FIELDS.has(key)) {
        const chosen = new Set(String(state[key]).split(","));
        for (const box of form.querySelectorAll(`input[name="${key}"]`)) box.checked = chosen.has(box.value);
      } else if (BOOLEAN_FIELDS.has(key)) input.checked = Boolean(state[key]);
      else input.value = String(state[key]);
    }
    writeMoreOptions(state.more);
    selectModelOption(state.model);
    renderGpuList();
    syncVisibility();
  }

  function readForm() {
    const state = { ...page.state };
    state.source = form.elements.model_source.value;
    const picked = $("model");
    if (picked.selectedIndex >= 0) state.model = picked.value;
    for (const key of Object.keys(DEFAULTS)) {
      if (key === "source" || key === "model") continue;
      const input = form.elements[key];
      if (!input) continue;
      if (LIST_FIELDS.has(key)) {
        state[key] = [...form.querySelectorAll(`input[name="${key}"]:checked`)].map((box) => box.value).join(",");
      } else if (BOOLEAN_FIELDS.has(key)) state[key] = input.checked;
      else if (INTEGER_FIELDS.has(key)) {
        const n = Number(input.value);
        state[key] = input.value.trim() === "" || !Number.isFinite(n) ? input.value : n;
      } else state[key] = input.value;
    }
    state.more = readMoreOptions();
    return state;
  }

  function syncVisibility() {
    const s = page.state;
    $("catalog-model").hidden = s.source !== "catalog";
    $("config-model").hidden = s.source !== "config";
    // (IA)³ and LN tuning take target modules but no rank; prompt and prefix tuning take
    // virtual tokens.
    const prompted = ["prompt-tuning", "prefix-tuning"].includes(s.method);
    $("lora-options").hidden = s.method === "full" || prompted;
    const ranked = !["ia3", "ln-tuning"].includes(s.method);
    $("rank-field").hidden = !ranked;
    $("alpha-field").hidden = !ranked;
    $("prompt-options").hidden = !prompted;
    $("dpo-options").hidden = !["dpo", "grpo"].includes(s.objective);
    $("precompute-field").hidden = s.objective !== "dpo";
    $("dpo-hint").hidden = s.objective !== "dpo";
    $("grpo-hint").hidden = s.objective !== "grpo";
    $("reward-hint").hidden = s.objective !== "reward";
    $("orpo-hint").hidden = s.objective !== "orpo";
    $("quant-options").hidden = s.method !== "qlora";
    $("placement-strategies").hidden = !placing(s);
  }

  // The fit-check places the job when it may span more GPUs than one.
  function placing(s) {
    return s.max_gpus !== 1;
  }

  // ------------------------------------------------------------------------------------------
  // The request body (JobSpec in openapi/openapi.json)

  function modulesFrom(text) {
    const trimmed = text.trim();
    if (!trimmed) return null;
    if (trimmed === "all-linear") return "all-linear";
    return trimmed.split(/[\s,]+/).filter(Boolean);
  }

  function jobFromState(s) {
    let model = s.model;
    if (s.source === "config") {
      let config;
      try {
        config = JSON.parse(s.config);
      } catch (err) {
        throw new FormError("config", `config.json is not valid JSON: ${err.message}`);
      }
      model = { hf_config: config };
    } else if (!model) {
      throw new FormError("model", "pick a model");
    }
    const job = {
      model,
      method: s.method,
      dtype: s.dtype,
      optim: s.optim,
      batch_size: s.batch_size,
      seq_len: s.seq_len,
      gradient_accumulation_steps: s.gradient_accumulation_steps,
      gradient_checkpointing: s.gradient_checkpointing,
      attn_implementation: s.attn_implementation,
      loss: s.loss || null,
      framework: s.framework,
      parallel: { gpus: s.gpu_count },
    };
    // Sent only when not the default, as the request's own defaults would fill them.
    if (s.packing) job.packing = true;
    if (s.liger_kernel) {
      job.liger_kernel = true;
      job.loss = null; // Liger's fused linear cross-entropy comes with it
    }
    if (s.strategy !== DEFAULTS.strategy) job.parallel.strategy = s.strategy;
    if (s.offload !== DEFAULTS.offload) job.parallel.offload = s.offload;
    if (["lora", "qlora", "lora-fa"].includes(s.method)) {
      job.lora = { r: s.lora_r, lora_alpha: s.lora_alpha, target_modules: modulesFrom(s.target_modules) };
    } else if (["vera", "loha", "lokr"].includes(s.method)) {
      // PEFT's own options for these (VeraConfig, LoHaConfig, LoKrConfig): rank and targets
      job[s.method] = { r: s.lora_r, target_modules: modulesFrom(s.target_modules) };
    } else if (s.method === "adalora") {
      // AdaLoraConfig: the rank is its initial rank init_r
      job.adalora = {
        init_r: s.lora_r,
        lora_alpha: s.lora_alpha,
        target_modules: modulesFrom(s.target_modules),
      };
    } else if (s.method === "oft") {
      // OFTConfig: the rank is its block count, given instead of a block size
      job.oft = { r: s.lora_r, oft_block_size: 0, target_modules: modulesFrom(s.target_modules) };
    } else if (s.method === "boft") {
      // BOFTConfig: the rank is its block count, given instead of a block size
      job.boft = {
        boft_block_num: s.lora_r,
        boft_block_size: 0,
        target_modules: modulesFrom(s.target_modules),
      };
    } else if (s.method === "ia3") {
      job.ia3 = { target_modules: modulesFrom(s.target_modules) };
    } else if (s.method === "ln-tuning") {
      job.ln_tuning = { target_modules: modulesFrom(s.target_modules) };
    } else if (s.method === "prompt-tuning") {
      job.prompt_tuning = { num_virtual_tokens: s.num_virtual_tokens };
    } else if (s.method === "prefix-tuning") {
      job.prefix_tuning = { num_virtual_tokens: s.num_virtual_tokens };
    }
    if (s.objective !== DEFAULTS.objective) {
      job.objective = s.objective;
      if (s.objective === "dpo") {
        job.dpo = {
          precompute_ref_log_probs: s.precompute_ref_log_probs,
          max_completion_length: s.max_completion_length === "" ? null : s.max_completion_length,
        };
      } else if (s.objective === "grpo") {
        // one prompt's group per optimizer step: every completion of the generation batch
        // (micro-batch x accumulation) samples the same prompt; half the sequence generated
        // unless the completion tokens are given
        job.grpo = {
          num_generations: s.batch_size * s.gradient_accumulation_steps,
          max_completion_length: s.max_completion_length === ""
            ? Math.max(1, Math.floor(s.seq_len / 2)) : s.max_completion_length,
        };
      }
    }
    if (s.method === "qlora") {
      const bnb = ["nf4", "fp4", "int8"].includes(s.quant_type);
      job.quantization = bnb
        ? {
          type: s.quant_type,
          double_quant: s.double_quant,
          compute_dtype: s.compute_dtype || null,
          prepare_kbit: s.prepare_kbit,
        }
        : {
          type: s.quant_type,
          prepare_kbit: s.prepare_kbit,
          bits: s.quant_bits === "" ? null : s.quant_bits,
          group_size: s.group_size === "" ? null : s.group_size,
        };
    }
    addMoreOptions(job, s.more);
    return job;
  }

  function offersFromState(s) {
    return s.gpus.map((gpu) => {
      const price = Number.parseFloat(gpu.price);
      const priced = Number.isFinite(price) && price >= 0 ? { price_per_hour: price } : {};
      if (gpu.memory_mib) return { memory_mib: gpu.memory_mib, ...priced };
      return priced.price_per_hour === undefined ? gpu.name : { name: gpu.name, ...priced };
    });
  }

  // The fit-check's `placement`: the fewest GPUs per GPU type and strategy, or null.
  function placementFromState(s) {
    if (!placing(s)) return null;
    const strategies = s.strategies.split(",").filter(Boolean);
    if (!strategies.length) throw new FormError("strategies", "pick a strategy to place the job under");
    return { strategies, max_gpus: s.max_gpus, gpus_per_node: s.gpus_per_node };
  }

  // A suggestion's `set`: job fields with their new values, named as in the request.
  function applyChanges(set) {
    const s = { ...page.state, more: { ...page.state.more } };
    for (const [key, value] of Object.entries(set)) {
      setMoreOptions(s.more, key, value);
      if (key === "lora" && value && typeof value === "object") {
        if ("r" in value) s.lora_r = value.r;
        if ("lora_alpha" in value) s.lora_alpha = value.lora_alpha;
        if ("target_modules" in value) {
          const t = value.target_modules;
          s.target_modules = t === null ? "" : Array.isArray(t) ? t.join(", ") : String(t);
        }
      } else if (key === "quantization" && value && typeof value === "object") {
        if ("type" in value) s.quant_type = value.type;
        if ("double_quant" in value) s.double_quant = Boolean(value.double_quant);
        if ("compute_dtype" in value) s.compute_dtype = value.compute_dtype || "";
        if ("prepare_kbit" in value) s.prepare_kbit = Boolean(value.prepare_kbit);
        if ("bits" in value) s.quant_bits = value.bits === null ? "" : value.bits;
        if ("group_size" in value) s.group_size = value.group_size === null ? "" : value.group_size;
      } else if (key === "parallel" && value && typeof value === "object") {
        if ("gpus" in value) s.gpu_count = value.gpus;
        if ("strategy" in value) s.strategy = value.strategy;
        if ("offload" in value) s.offload = value.offload;
      } else if (key === "loss") {
        s.loss = value || "";
      } else if (key in DEFAULTS) {
        s[key] = value;
      }
    }
    page.state = s;
    writeForm(s);
    changed();
  }

  // ------------------------------------------------------------------------------------------
  // API calls

  class FormError extends Error {
    constructor(field, message) {
      super(message);
      this.field = field;
    }
  }

  class ProblemError extends Error {
    constructor(problem) {
      super(problem.detail || problem.title || "request failed");
      this.problem = problem;
    }
  }

  async function api(path, body, signal) {
    const init = body === undefined
      ? { signal, headers: { Accept: "application/json" } }
      : {
          method: "POST",
          signal,
          headers: { "Content-Type": "application/json", Accept: "application/json" },
          body: JSON.stringify(body),
        };
    const response = await fetch(path, init);
    let payload = null;
    try {
      payload = await response.json();
    } catch {
      payload = null;
    }
    if (!response.ok) {
      throw new ProblemError(payload || { title: `HTTP ${response.status}`, status: response.status });
    }
    return payload;
  }

  async function modelDetails(id, signal) {
    if (!id) return null;
    if (!page.modelDetails.has(id)) {
      try {
        page.modelDetails.set(id, await api(`${API.models}/${id}`, undefined, signal));
      } catch (err) {
        if (err.name === "AbortError") throw err;
        return null; // the details only refine hints and the curves' range
      }
    }
    return page.modelDetails.get(id);
  }

  // The x values of a curve: powers of two across the range, the job's own value, and each
  // GPU's largest fitting value with the one above it (so the marks sit on API answers).
  function curvePoints(own, fitting, low, high) {
    const xs = new Set([own]);
    for (let x = low; x <= high; x *= 2) xs.add(x);
    for (const f of fitting) {
      if (f >= 1 && f <= high) xs.add(f);
      if (f + 1 <= high) xs.add(f + 1);
    }
    return [...xs].filter((x) => x >= 1).sort((a, b) => a - b);
  }

  function pow2Ceil(n) {
    let p = 1;
    while (p < n) p *= 2;
    return p;
  }

  async function curves(job, fits, context, signal) {
    const maxBatches = fits.map((f) => f.max_batch_size).filter((v) => v > 0);
    const maxSeqs = fits.map((f) => f.max_seq_len).filter((v) => v > 0);
    const batchHigh = Math.min(
      MAX_BATCH_SIZE,
      pow2Ceil(Math.max(64, job.batch_size * 2, ...maxBatches.map((v) => v + 1))),
    );
    const seqCap = Math.min(MAX_SEQ_LEN, Math.max(context || 0, job.seq_len));
    const seqHigh = Math.min(
      seqCap,
      pow2Ceil(Math.max(8192, job.seq_len * 2, ...maxSeqs.map((v) => v + 1))),
    );
    const seqLow = Math.min(128, pow2Ceil(job.seq_len) / 2 || 1);
    const batchXs = curvePoints(job.batch_size, maxBatches, 1, batchHigh);
    const seqXs = curvePoints(job.seq_len, maxSeqs, Math.max(1, seqLow), seqHigh).filter(
      (x) => x <= seqCap,
    );
    const jobs = [
      ...batchXs.map((x) => ({ ...job, batch_size: x })),
      ...seqXs.map((x) => ({ ...job, seq_len: x })),
    ];
    const answer = await api(API.batch, { jobs }, signal);
    const points = (xs, offset) =>
      xs
        .map((x, i) => ({ x, result: answer.results[offset + i] }))
        .filter((p) => p.result && p.result.estimate)
        .map((p) => ({
          x: p.x,
          upper: p.result.estimate.peak.device_bytes_upper,
          device: p.result.estimate.peak.device_bytes,
        }));
    return { batch: points(batchXs, 0), seq: points(seqXs, batchXs.length) };
  }

  // ------------------------------------------------------------------------------------------
  // The update cycle: form -> URL -> API -> page

  function setPageState(value) {
    resultsEl.dataset.state = value;
    const words = { pending: "Updating…", loading: "Updating…", ready: "Up to date.", error: "" };
    $("status").textContent = words[value] ?? "";
  }

  function changed() {
    page.state = readForm();
    syncVisibility();
    history.replaceState(null, "", urlFromState(page.state));
    $("share-link").value = location.href;
    // Answers still in flight are for the old form: drop them, so none can mark the page ready.
    page.generation += 1;
    if (page.controller) page.controller.abort();
    setPageState("pending");
    clearTimeout(page.timer);
    page.timer = setTimeout(update, DEBOUNCE_MS);
  }

  async function update() {
    const generation = ++page.generation;
    if (page.controller) page.controller.abort();
    const controller = new AbortController();
    page.controller = controller;
    const { signal } = controller;
    const current = () => generation === page.generation;
    clearInvalid();
    setPageState("loading");
    try {
      const state = page.state;
      const job = jobFromState(state);
      const offers = offersFromState(state);
      const placement = offers.length ? placementFromState(state) : null;
      const fitBody = placement ? { job, gpus: offers, placement } : { job, gpus: offers };
      const detailsPromise =
        state.source === "catalog" ? modelDetails(state.model, signal) : Promise.resolve(null);
      const [estimate, fit, details] = await Promise.all([
        api(API.estimate, job, signal),
        offers.length ? api(API.fitCheck, fitBody, signal) : Promise.resolve(null),
        detailsPromise,
      ]);
      if (!current()) return;
      const context = Number(
        details?.architecture?.max_position_embeddings ??
          job.model?.hf_config?.max_position_embeddings ??
          0,
      );
      renderModelHint(details);
      renderEstimate(estimate);
      renderFit(fit);
      renderPlacement(fit ? fit.placement : null);
      resultsEl.dataset.generation = String(generation);
      const curveData = await curves(job, fit ? fit.results : [], context, signal);
      if (!current()) return;
      page.last = { estimate, fit, curves: curveData, job };
      renderCurves();
      hideError();
      setPageState("ready");
    } catch (err) {
      if (err.name === "AbortError" || !current()) return;
      showError(err);
      setPageState("error");
    }
  }

  // ------------------------------------------------------------------------------------------
  // Errors

  const POINTER_FIELDS = {
    "/model": "model",
    "/model/hf_config": "config",
    "/batch_size": "batch_size",
    "/seq_len": "seq_len",
    "/gradient_accumulation_steps": "gradient_accumulation_steps",
    "/lora/r": "lora_r",
    "/lora/lora_alpha": "lora_alpha",
    "/lora/target_modules": "target_modules",
    "/ia3/target_modules": "target_modules",
    "/ln_tuning/target_modules": "target_modules",
    "/prompt_tuning/num_virtual_tokens": "num_virtual_tokens",
    "/prefix_tuning/num_virtual_tokens": "num_virtual_tokens",
    "/objective": "objective",
    "/dpo/max_completion_length": "max_completion_length",
    "/grpo/max_completion_length": "max_completion_length",
    "/quantization": "quant_type",
    "/quantization/bits": "quant_bits",
    "/quantization/group_size": "group_size",
    "/parallel/gpus": "gpu_count",
    "/job/parallel/gpus": "gpu_count",
    "/parallel/strategy": "strategy",
    "/job/parallel/strategy": "strategy",
    "/parallel/offload": "offload",
    "/job/parallel/offload": "offload",
    "/placement/strategies": "strategies",
    "/placement/max_gpus": "max_gpus",
    "/placement/gpus_per_node": "gpus_per_node",
  };

  function fieldForPointer(pointer) {
    const bare = pointer.replace(/^\/job(?=\/)/, "");
    let best = null;
    for (const [prefix, field] of Object.entries(POINTER_FIELDS)) {
      if ((bare === prefix || bare.startsWith(`${prefix}/`)) && (!best || prefix.length > best[0].length)) {
        best = [prefix, field];
      }
    }
    if (best) return best[1];
    const path = bare.slice(1).split("/").join(".");
    return page.moreByPath.has(path) ? path : null;
  }

  function clearInvalid() {
    for (const node of form.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  }

  function markInvalid(field) {
    const node = field === "model" ? $("model") : field === "strategies" ? $("placement-strategies") : form.elements[field];
    if (node && node.setAttribute) node.setAttribute("aria-invalid", "true");
  }

  function showError(err) {
    const box = $("error");
    box.replaceChildren();
    if (err instanceof FormError) {
      box.append(el("p", { text: err.message }));
      markInvalid(err.field);
    } else if (err instanceof ProblemError) {
      const p = err.problem;
      box.append(el("p", {}, el("strong", { text: p.title || "The request failed" }), ` ${p.detail || ""}`));
      const items = (p.errors || []).map((e) => {
        const field = fieldForPointer(e.pointer || "");
        if (field) markInvalid(field);
        return el("li", { text: `${e.pointer || "/"}: ${e.detail}` });
      });
      if (items.length) box.append(el("ul", {}, ...items));
      if (p.suggestions && p.suggestions.length) {
        box.append(el("p", { text: `Closest: ${p.suggestions.join(", ")}` }));
      }
    } else {
      box.append(el("p", { text: `The service did not answer: ${err.message}` }));
    }
    box.hidden = false;
  }

  function hideError() {
    $("error").hidden = true;
    $("error").replaceChildren();
  }

  // ------------------------------------------------------------------------------------------
  // Rendering: the estimate

  function setBytes(id, bytes) {
    const node = $(id);
    node.textContent = gibText(bytes);
    node.dataset.bytes = String(bytes);
  }

  function renderModelHint(details) {
    const hint = $("target-hint");
    hint.replaceChildren("Comma-separated module names, or ", el("code", { text: "all-linear" }), ".");
    if (details?.architecture?.linear_modules?.length) {
      hint.append(` This model's: ${details.architecture.linear_modules.join(", ")}.`);
    }
  }

  function renderEstimate(est) {
    $("summary").hidden = false;
    setBytes("peak-allocated", est.peak.allocated_bytes);
    setBytes("peak-reserved", est.peak.reserved_bytes);
    setBytes("peak-device", est.peak.device_bytes);
    setBytes("peak-safe", est.peak.device_bytes_upper);
    const stepWords = est.peak.step === 1
      ? "in the first step, before the optimizer state exists"
      : `in the steady state (step ${est.peak.step})`;
    const phase = $("peak-phase");
    phase.textContent = `The peak comes ${est.peak.phase_words}, ${stepWords}.`;
    phase.dataset.phase = est.peak.phase;
    $("param-counts").textContent =
      `${countText(est.params.total)} parameters, ${countText(est.params.trainable)} trainable. ` +
      `Estimator ${est.estimator_version}.`;

    const notes = $("notes");
    const warnings = $("warnings");
    const assumptions = $("assumptions");
    warnings.replaceChildren(...est.warnings.map((w) => el("li", { text: w })));
    assumptions.replaceChildren(...est.assumptions.map((a) => el("li", { text: a })));
    notes.hidden = est.warnings.length + est.assumptions.length === 0;

    renderLegend(est);
    renderCalibration(est);
  }

  // What the safe bound adds to the device level (the legend's hatched part), not the bound.
  function safeMargin(est) {
    return Math.max(0, est.peak.device_bytes_upper - est.peak.device_bytes);
  }

  function breakdownSegments(est) {
    const segments = [];
    for (const [key, bytes] of Object.entries(est.components)) {
      if (bytes > 0) segments.push({ key, bytes, ...(COMPONENT_STYLE[key] || { label: key, color: "#374151" }) });
    }
    for (const [key, bytes] of Object.entries(est.overheads)) {
      if (bytes > 0) segments.push({ key, bytes, overhead: true, ...(OVERHEAD_STYLE[key] || { label: key, color: "#57534e" }) });
    }
    return segments;
  }

  function renderLegend(est) {
    const legend = $("breakdown-legend");
    legend.replaceChildren(
      ...breakdownSegments(est).map((seg) =>
        el(
          "li",
          { dataset: { component: seg.key, bytes: String(seg.bytes) } },
          el("span", { class: `swatch${seg.overhead ? " overhead" : ""}`, style: `background:${seg.color}`, "aria-hidden": "true" }),
          el("span", { class: "legend-label", text: seg.label }),
          el("span", { class: "legend-value", text: gibText(seg.bytes) }),
        ),
      ),
      el(
        "li",
        { dataset: { component: "safe_margin" } },
        el("span", { class: "swatch margin", "aria-hidden": "true" }),
        el("span", { class: "legend-label", text: "Safe bound: margin over device" }),
        el("span", { class: "legend-value", dataset: { bytes: String(safeMargin(est)) }, text: gibText(safeMargin(est)) }),
      ),
    );
    $("breakdown-figure").hidden = false;
  }

  function renderBreakdownChart(est) {
    const host = $("breakdown-chart");
    const width = Math.max(280, host.clientWidth || 600);
    const levels = [
      { key: "allocated", label: "Allocated", bytes: est.peak.allocated_bytes },
      { key: "reserved", label: "Reserved", bytes: est.peak.reserved_bytes },
      { key: "device", label: "Device", bytes: est.peak.device_bytes },
      { key: "safe", label: "Safe bound", bytes: est.peak.device_bytes_upper },
    ];
    const segments = breakdownSegments(est);
    const total = segments.reduce((sum, s) => sum + s.bytes, 0);
    const top = Math.max(total, ...levels.map((l) => l.bytes), 1);
    const pad = 4;
    const rowH = 17;
    const barY = levels.length * rowH + 8;
    const barH = 34;
    const height = barY + barH + 26;
    const x = (bytes) => pad + (bytes / top) * (width - 2 * pad);
    const root = svg("svg", {
      width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-labelledby": "breakdown-title",
    });
    root.append(
      svg("title", { id: "breakdown-title" },
        `Peak by component: allocated ${gibText(levels[0].bytes)}, reserved ${gibText(levels[1].bytes)}, ` +
        `device ${gibText(levels[2].bytes)}, safe bound ${gibText(levels[3].bytes)}`),
    );
    const defs = svg("defs");
    const hatch = svg("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
    hatch.append(svg("rect", { width: 6, height: 6, fill: "#f1f5f9" }), svg("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#475569", "stroke-width": 2 }));
    defs.append(hatch);
    root.append(defs);

    let at = 0;
    for (const seg of segments) {
      const rect = svg("rect", {
        x: x(at), y: barY, width: Math.max(0.5, x(at + seg.bytes) - x(at)), height: barH,
        fill: seg.color, stroke: "#ffffff", "stroke-width": 1,
      });
      rect.append(svg("title", {}, `${seg.label}: ${gibText(seg.bytes)}`));
      root.append(rect);
      at += seg.bytes;
    }
    if (est.peak.device_bytes_upper > at) {
      const rect = svg("rect", {
        x: x(at), y: barY, width: x(est.peak.device_bytes_upper) - x(at), height: barH,
        fill: "url(#hatch)", stroke: "#475569", "stroke-width": 1,
      });
      rect.append(svg("title", {}, `Safe bound: margin over device ${gibText(safeMargin(est))}`));
      root.append(rect);
    }
    // One row per level. End-anchored labels sit left of their marker, so rows run from the
    // largest level down and no marker crosses a label below it (start-anchored: the reverse).
    const anchorEnd = x(levels[0].bytes) > width * 0.5;
    const rows = [...levels].sort((a, b) => (anchorEnd ? b.bytes - a.bytes : a.bytes - b.bytes));
    rows.forEach((level, i) => {
      const lx = x(level.bytes);
      const ty = (i + 1) * rowH - 4;
      root.append(
        svg("line", { x1: lx, x2: lx, y1: ty - 10, y2: barY + barH + 4, stroke: "#111827", "stroke-width": 1.5, "stroke-dasharray": level.key === "safe" ? "4 2" : "none" }),
        svg("text", { x: anchorEnd ? lx - 5 : lx + 5, y: ty, "text-anchor": anchorEnd ? "end" : "start", class: "chart-label level-label", "data-level": level.key }, `${level.label} ${gib(level.bytes)} GiB`),
      );
    });
    root.append(
      svg("text", { x: pad, y: height - 6, class: "chart-axis" }, "0"),
      svg("text", { x: width - pad, y: height - 6, "text-anchor": "end", class: "chart-axis" }, `${gib(top)} GiB`),
    );
    host.replaceChildren(root);
  }

  const FACTOR_STATE_WORDS = {
    fresh: "The factors are current: reloaded from the store within seconds.",
    stale: "The store is unreachable: these are the last factors the service loaded.",
    none: "The store could not be read and no factors were ever loaded: the numbers are uncalibrated.",
  };

  function factorText(value) {
    return value === null || value === undefined ? "—" : value.toFixed(3);
  }

  function renderCalibration(est) {
    const c = est.calibration;
    const text = $("calibration-text");
    text.replaceChildren();
    const item = (id, label, value) => el("div", {}, el("dt", { text: label }), el("dd", { id: `calibration-${id}`, text: value }));
    const dl = el("dl", { class: "calibration" },
      item("applied", "Applied", c.applied ? "yes" : "no"),
      item("scope", "Scope", c.scope),
      item("factor", "Factor (device)", factorText(c.factor)),
      item("spread", "Safe bound over device", c.upper_multiplier === null || c.upper_multiplier === undefined ? "—" : `×${c.upper_multiplier.toFixed(3)}`),
      item("samples", "Samples", String(c.samples)),
      item("nodes", "Nodes", String(c.nodes)),
    );
    const margin = `${(est.upper_margin * 100).toFixed(1)} %`;
    const words = !c.applied
      ? `No measured peaks apply to this job yet: these are the estimator's own numbers, and the ` +
        `safe bound adds the estimator's margin of ${margin} to the device level.`
      : c.upper_multiplier === null || c.upper_multiplier === undefined
        ? `Measured peaks corrected the levels listed below; the device level has no factor yet, ` +
          `so the safe bound adds the estimator's margin of ${margin} to it.`
        : `Measured peaks from ${c.samples} runs on ${c.nodes} training nodes corrected these ` +
          `numbers; the safe bound adds ${margin} to the corrected device level: the measured ` +
          `spread, kept wide while few nodes agree.`;
    text.append(el("p", { text: words }), dl);
    const levels = c.levels || [];
    if (levels.length) {
      text.append(
        el("div", { class: "table-wrap" },
          el("table", { id: "calibration-levels" },
            el("caption", { text: "Factors per level" }),
            el("thead", {}, el("tr", {}, ...["Level", "Scope", "Factor", "Samples", "Nodes"].map((h, i) => el("th", { scope: "col", class: i >= 2 ? "num" : null, text: h })))),
            el("tbody", {}, ...levels.map((l) => el("tr", { dataset: { level: l.level } },
              el("th", { scope: "row", text: l.level }),
              el("td", { text: l.scope }),
              el("td", { class: "num", text: factorText(l.factor) }),
              el("td", { class: "num", text: String(l.samples) }),
              el("td", { class: "num", text: String(l.nodes) }),
            ))),
          ),
        ),
      );
    }
    if (c.state && FACTOR_STATE_WORDS[c.state]) {
      text.append(el("p", { id: "calibration-state", class: c.state === "fresh" ? "hint" : "stale", dataset: { state: c.state }, text: FACTOR_STATE_WORDS[c.state] }));
    }
    $("calibration-section").hidden = false;
  }

  // ------------------------------------------------------------------------------------------
  // Rendering: the fit check

  // A GPU given by its memory says so: the catalog GPU it was matched to is one of those that
  // report that total, not necessarily the one the job runs on.
  function gpuLabel(result) {
    const gpu = result.gpu;
    let name = gpu.name || gpu.requested;
    if (gpu.matched_by === "memory_mib") {
      const size = `${gib(gpu.memory_bytes)} GiB`;
      name = gpu.name
        ? `matched by size: ${size} → ${gpu.driver_name ? gpu.driver_name.replace(/^NVIDIA /, "") : gpu.name}`
        : `by size: ${size} (no catalog GPU of this size)`;
    }
    return result.count > 1 ? `${name} ×${result.count}` : name;
  }

  // The other catalog GPUs that report the same total as a GPU matched by size.
  function sameSize(result) {
    if (result.gpu.matched_by !== "memory_mib") return null;
    const others = page.gpus.filter((g) => g.memory_mib === result.gpu.memory_mib && g.name !== result.gpu.name);
    return others.length ? `Same size: ${others.map((g) => g.name).join(", ")}` : null;
  }

  function renderFit(fit) {
    const section = $("fit-section");
    if (!fit) {
      section.hidden = true;
      return;
    }
    section.hidden = false;
    const cheapest = fit.cheapest ? fit.cheapest.index : -1;
    const rows = fit.results.map((r, i) => {
      // Explicit roles keep the table's semantics when narrow screens restyle rows as cards.
      const cell = (label, attrs, ...children) => el("td", { role: "cell", "data-label": label, ...attrs }, ...children);
      const cost = r.cost_per_hour === null || r.cost_per_hour === undefined
        ? cell("Cost / h", { class: "num cost", text: "—" })
        : cell("Cost / h", { class: "num cost" }, r.cost_per_hour.toFixed(2), i === cheapest ? el("span", { class: "badge", text: "cheapest" }) : null);
      return el(
        "tr",
        { role: "row", dataset: { gpu: r.gpu.name || r.gpu.requested, fits: String(r.fits) }, class: i === cheapest ? "cheapest" : null },
        el("th", { role: "rowheader", scope: "row", class: r.gpu.matched_by === "memory_mib" ? "by-size" : null, title: sameSize(r), text: gpuLabel(r) }),
        cell("Fits", { class: r.fits ? "fits yes" : "fits no" }, el("span", { "aria-hidden": "true", text: r.fits ? "✓ " : "✗ " }), r.fits ? "yes" : "no"),
        cell("Usable GiB", { class: "num usable", dataset: { bytes: String(r.usable_bytes) }, text: gib(r.usable_bytes) }),
        cell("Headroom GiB", { class: `num headroom${r.headroom_bytes < 0 ? " negative" : ""}`, dataset: { bytes: String(r.headroom_bytes) }, text: signedGib(r.headroom_bytes) }),
        cell("Max batch", { class: "num max-batch", text: String(r.max_batch_size) }),
        cell("Max seq", { class: "num max-seq", text: String(r.max_seq_len) }),
        cost,
      );
    });
    $("fit-table").tBodies[0].replaceChildren(...rows);
    renderSuggestions(fit);
  }

  const STRATEGY_WORDS = { ddp: "DDP", fsdp: "FSDP", fsdp2: "FSDP2", zero1: "ZeRO-1", zero2: "ZeRO-2", zero3: "ZeRO-3" };

  function renderPlacement(placed) {
    const section = $("placement-section");
    if (!placed) {
      section.hidden = true;
      return;
    }
    section.hidden = false;
    $("placement-hint").textContent =
      `Up to ${placed.max_gpus} GPUs of each type, ${placed.gpus_per_node} per node; the micro-batch and sequence stay per GPU.`;
    const picked = (word, index) =>
      placed[word] && placed[word].index === index ? el("span", { class: "badge", text: word }) : null;
    const rows = placed.placements.map((p, i) => {
      const cell = (label, attrs, ...children) => el("td", { role: "cell", "data-label": label, ...attrs }, ...children);
      const head = [
        el("th", { role: "rowheader", scope: "row", text: p.gpu }),
        cell("Strategy", { class: "strategy", text: STRATEGY_WORDS[p.strategy] || p.strategy }),
      ];
      const attrs = { role: "row", dataset: { gpu: p.gpu, strategy: p.strategy, outcome: p.outcome } };
      if (p.count === null || p.count === undefined) {
        return el("tr", attrs, ...head, cell("GPUs", { class: "reason", colspan: "4", text: p.reason || p.outcome }));
      }
      const cheapest = picked("cheapest", i);
      return el(
        "tr",
        { ...attrs, class: cheapest ? "cheapest" : null },
        ...head,
        cell("GPUs", { class: "num count", text: String(p.count) }, picked("fewest", i)),
        cell("Nodes", { class: "num nodes", text: String(p.nodes) }),
        cell("GiB per GPU", {
          class: "num per-gpu",
          dataset: { bytes: String(p.required_bytes) },
          title: `of ${gibText(p.usable_bytes)} usable`,
          text: gib(p.required_bytes),
        }),
        p.cost_per_hour === null || p.cost_per_hour === undefined
          ? cell("Cost / h", { class: "num cost", text: "—" })
          : cell("Cost / h", { class: "num cost", text: p.cost_per_hour.toFixed(2) }, cheapest),
      );
    });
    $("placement-table").tBodies[0].replaceChildren(...rows);
  }

  function renderSuggestions(fit) {
    const list = $("suggestions");
    const groups = fit.results.filter((r) => !r.fits && r.suggestions.length);
    list.replaceChildren(
      ...groups.map((r) =>
        el(
          "li",
          { class: "suggestion-group", dataset: { gpu: r.gpu.name || r.gpu.requested } },
          el("h4", { text: `On ${r.gpu.matched_by === "memory_mib" ? "the GPU " : ""}${gpuLabel(r)} (usable ${gibText(r.usable_bytes)})` }),
          el(
            "ol",
            {},
            ...r.suggestions.map((sug, rank) => {
              const apply = el("button", {
                type: "button",
                class: "apply",
                "aria-label": `Apply: ${sug.description}`,
                text: "Apply",
              });
              apply.addEventListener("click", () => applyChanges(sug.set));
              return el(
                "li",
                { class: "suggestion", dataset: { rank: String(rank), bytes: String(sug.required_bytes), fits: String(sug.fits), set: JSON.stringify(sug.set) } },
                el("span", { class: "suggestion-text", text: sug.description }),
                el("span", { class: `suggestion-result ${sug.fits ? "yes" : "no"}`, text: `${gibText(sug.required_bytes)} — ${sug.fits ? "fits" : "still too big"}` }),
                apply,
              );
            }),
          ),
        ),
      ),
    );
    $("suggestions-block").hidden = groups.length === 0;
  }

  // ------------------------------------------------------------------------------------------
  // Rendering: the curves

  function niceStep(range, target) {
    const raw = range / target;
    const mag = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
    return 10 * mag;
  }

  function renderCurve(host, points, opts) {
    const width = Math.max(280, host.clientWidth || 600);
    const narrow = width < 480;
    const height = narrow ? 240 : 280;
    const m = { left: 46, right: 12, top: 14, bottom: 40 };
    const pw = width - m.left - m.right;
    const ph = height - m.top - m.bottom;
    const xs = points.map((p) => p.x);
    const xMin = Math.min(...xs);
    const xMax = Math.max(...xs);
    const lx = (v) => Math.log2(v);
    const x = (v) => m.left + (xMax === xMin ? pw / 2 : ((lx(v) - lx(xMin)) / (lx(xMax) - lx(xMin))) * pw);
    const gpus = opts.gpus;
    const ownPoint = points.find((p) => p.x === opts.own);
    const curveMax = Math.max(...points.map((p) => p.upper));
    const yTop = gpus.length
      ? Math.max(...gpus.map((g) => g.usable_bytes)) * 1.15
      : curveMax * 1.05;
    const yMax = Math.max(yTop, ownPoint ? ownPoint.upper * 1.08 : 0, 1) / GIB;
    const y = (bytes) => m.top + ph - (bytes / GIB / yMax) * ph;
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-labelledby": `${host.id}-title ${host.id}-desc` });
    root.append(svg("title", { id: `${host.id}-title` }, opts.title));
    const fitsWords = gpus.map((g) => `${g.label}: ${opts.maxOf(g)}`).join("; ");
    root.append(svg("desc", { id: `${host.id}-desc` }, `${points.length} points from ${opts.xLabel} ${xMin} to ${xMax}. Largest that fits — ${fitsWords || "no GPU selected"}.`));
    const clipId = `${host.id}-clip`;
    const clip = svg("clipPath", { id: clipId });
    clip.append(svg("rect", { x: m.left, y: m.top, width: pw, height: ph }));
    root.append(clip);

    // Grid and y axis.
    const step = niceStep(yMax, narrow ? 4 : 5);
    for (let v = 0; v <= yMax + 1e-9; v += step) {
      const yy = y(v * GIB);
      root.append(
        svg("line", { x1: m.left, x2: m.left + pw, y1: yy, y2: yy, class: "grid" }),
        svg("text", { x: m.left - 6, y: yy + 4, "text-anchor": "end", class: "chart-axis" }, Number.isInteger(v) ? String(v) : v.toFixed(1)),
      );
    }
    root.append(svg("text", { x: 12, y: m.top + ph / 2, transform: `rotate(-90 12 ${m.top + ph / 2})`, "text-anchor": "middle", class: "chart-axis" }, "GiB"));

    // X axis: powers of two, thinned so labels never touch.
    const ticks = [];
    for (let v = 2 ** Math.ceil(Math.log2(xMin)); v <= xMax; v *= 2) ticks.push(v);
    const minGap = 42;
    let lastX = -Infinity;
    for (const t of ticks) {
      const tx = x(t);
      if (tx - lastX < minGap) continue;
      lastX = tx;
      root.append(
        svg("line", { x1: tx, x2: tx, y1: m.top + ph, y2: m.top + ph + 4, stroke: "#374151" }),
        svg("text", { x: tx, y: m.top + ph + 16, "text-anchor": "middle", class: "chart-axis" }, opts.tick(t)),
      );
    }
    root.append(
      svg("line", { x1: m.left, x2: m.left + pw, y1: m.top + ph, y2: m.top + ph, stroke: "#374151" }),
      svg("text", { x: m.left + pw / 2, y: height - 4, "text-anchor": "middle", class: "chart-axis" }, opts.xLabel),
    );

    // GPU lines, and their largest fitting x.
    const plot = svg("g", { "clip-path": `url(#${clipId})` });
    root.append(plot);
    gpus.forEach((g, i) => {
      const color = GPU_COLORS[i % GPU_COLORS.length];
      const gy = y(g.usable_bytes);
      plot.append(svg("line", { x1: m.left, x2: m.left + pw, y1: gy, y2: gy, stroke: color, "stroke-width": 1.5, "stroke-dasharray": "6 3" }));
      const best = opts.maxOf(g);
      const bp = points.find((p) => p.x === best);
      if (bp) {
        const bx = x(bp.x);
        plot.append(
          svg("line", { x1: bx, x2: bx, y1: y(bp.upper), y2: m.top + ph, stroke: color, "stroke-width": 1.5, "stroke-dasharray": "2 2" }),
          svg("circle", { cx: bx, cy: y(bp.upper), r: 5, fill: "#ffffff", stroke: color, "stroke-width": 2.5, class: "fit-mark", "data-gpu": g.label, "data-x": String(bp.x) }),
        );
      }
    });

    // The curves: the median device level (dashed) and the safe bound (solid).
    const path = (key) => points.map((p, i) => `${i ? "L" : "M"}${x(p.x).toFixed(1)},${y(p[key]).toFixed(1)}`).join("");
    plot.append(
      svg("path", { d: path("device"), fill: "none", stroke: "#6b7280", "stroke-width": 1.5, "stroke-dasharray": "5 3" }),
      svg("path", { d: path("upper"), fill: "none", stroke: "#111827", "stroke-width": 2.25 }),
    );
    for (const p of points) {
      plot.append(svg("circle", { cx: x(p.x), cy: y(p.upper), r: p.x === opts.own ? 5.5 : 2.5, fill: p.x === opts.own ? "#111827" : "#ffffff", stroke: "#111827", "stroke-width": 1.5, class: p.x === opts.own ? "own-point" : "point" }));
    }
    if (ownPoint && y(ownPoint.upper) >= m.top) {
      // The curve rises to the right: above-left of the point is free, or below-right near the axis.
      const ox = x(ownPoint.x);
      const oy = y(ownPoint.upper);
      const left = ox - m.left > 120;
      root.append(svg("text", { x: left ? ox - 9 : ox + 9, y: left ? Math.max(m.top + 10, oy - 9) : oy + 18, "text-anchor": left ? "end" : "start", class: "chart-label own-label" }, `this job ${gib(ownPoint.upper)} GiB`));
    }
    host.replaceChildren(root, curveKey(gpus, opts), curveTable(points, opts));
  }

  function curveKey(gpus, opts) {
    const items = [
      el("li", {}, el("span", { class: "key-line solid", "aria-hidden": "true" }), "safe bound"),
      el("li", {}, el("span", { class: "key-line dashed", "aria-hidden": "true" }), "device level (median)"),
      ...gpus.map((g, i) => {
        const best = opts.maxOf(g);
        return el(
          "li",
          { class: "gpu-key", dataset: { gpu: g.label, max: String(best) } },
          el("span", { class: "key-line gpu", style: `border-color:${GPU_COLORS[i % GPU_COLORS.length]}`, "aria-hidden": "true" }),
          `${g.label}: usable ${gibText(g.usable_bytes)}, largest ${opts.xWord} that fits `,
          el("strong", { text: best > 0 ? String(best) : "none" }),
        );
      }),
    ];
    return el("ul", { class: "curve-key" }, ...items);
  }

  function curveTable(points, opts) {
    return el(
      "details",
      { class: "curve-data" },
      el("summary", { text: "Data" }),
      el(
        "div", { class: "table-wrap" },
        el(
          "table", {},
          el("thead", {}, el("tr", {}, el("th", { scope: "col", text: opts.xLabel }), el("th", { scope: "col", class: "num", text: "Safe bound" }), el("th", { scope: "col", class: "num", text: "Device" }))),
          el(
            "tbody", {},
            ...points.map((p) =>
              el(
                "tr",
                { dataset: { x: String(p.x), bytes: String(p.upper) }, class: p.x === opts.own ? "own" : null },
                el("th", { scope: "row", text: String(p.x) }),
                el("td", { class: "num", text: gibText(p.upper) }),
                el("td", { class: "num", dataset: { bytes: String(p.device) }, text: gibText(p.device) }),
              ),
            ),
          ),
        ),
      ),
    );
  }

  function renderCurves() {
    if (!page.last) return;
    const { estimate, fit, curves: data, job } = page.last;
    renderBreakdownChart(estimate);
    const gpus = fit ? fit.results.map((r) => ({ label: gpuLabel(r), usable_bytes: r.usable_bytes, max_batch_size: r.max_batch_size, max_seq_len: r.max_seq_len })) : [];
    $("curves-section").hidden = false;
    $("batch-caption").textContent = `Safe bound against micro-batch, at sequence length ${job.seq_len}`;
    $("seq-caption").textContent = `Safe bound against sequence length, at micro-batch ${job.batch_size}`;
    if (data.batch.length) {
      renderCurve($("batch-chart"), data.batch, {
        title: "Peak memory against micro-batch",
        xLabel: "micro-batch",
        xWord: "micro-batch",
        own: job.batch_size,
        gpus,
        maxOf: (g) => g.max_batch_size,
        tick: String,
      });
    }
    if (data.seq.length) {
      renderCurve($("seq-chart"), data.seq, {
        title: "Peak memory against sequence length",
        xLabel: "sequence length (tokens)",
        xWord: "sequence",
        own: job.seq_len,
        gpus,
        maxOf: (g) => g.max_seq_len,
        tick: tokensText,
      });
    }
  }

  // ------------------------------------------------------------------------------------------
  // Pickers

  function normalize(text) {
    return text.toLowerCase().replace(/[^a-z0-9.]+/g, " ");
  }

  function renderModelOptions() {
    const select = $("model");
    const terms = normalize($("model-search").value).split(" ").filter(Boolean);
    const matching = page.models.filter((m) => {
      const hay = normalize([m.id, ...m.aliases, m.model_type].join(" ")).replace(/ /g, "");
      return terms.every((t) => hay.includes(t));
    });
    select.replaceChildren(
      ...matching.map((m) => el("option", { value: m.id, text: `${m.id} — ${countText(m.total_params)}` })),
    );
    selectModelOption(page.state.model);
    $("model-count").textContent = `${matching.length} of ${page.models.length} models`;
  }

  function selectModelOption(id) {
    const select = $("model");
    select.value = id;
    if (select.value !== id) select.selectedIndex = -1;
  }

  function renderGpuList() {
    const list = $("gpu-list");
    const terms = normalize($("gpu-search").value).split(" ").filter(Boolean);
    const chosen = new Map(page.state.gpus.map((g) => [g.name, g]));
    const bySize = page.state.gpus.filter((g) => g.memory_mib);
    const chosenFirst = [
      ...page.state.gpus.map((c) => page.gpus.find((g) => g.name === c.name)).filter(Boolean),
      ...page.gpus.filter((g) => !chosen.has(g.name)),
    ];
    const rows = [
      ...bySize.map((g) => gpuRow(g.name, `${g.memory_mib} MiB`, `${gib(g.memory_mib * 1024 * 1024)} GiB`, g)),
      ...chosenFirst
        .filter((g) => {
          if (chosen.has(g.name)) return true;
          const hay = normalize(`${g.name} ${g.driver_name}`).replace(/ /g, "");
          return terms.every((t) => hay.includes(t));
        })
        .map((g) => gpuRow(g.name, g.name, `${gib(g.memory_bytes)} GiB`, chosen.get(g.name))),
    ];
    list.replaceChildren(...rows);
  }

  // Chosen GPUs in the order the list shows them: by size first, then the catalog's order.
  function setChosenGpus(next) {
    page.state.gpus = [
      ...next.filter((n) => n.memory_mib),
      ...page.gpus.map((x) => next.find((n) => n.name === x.name)).filter(Boolean),
    ];
  }

  function gpuRow(key, label, memText, pick) {
    const id = `gpu-${key.replace(/[^A-Za-z0-9]/g, "_")}`;
    const box = el("input", { type: "checkbox", id, value: key, checked: Boolean(pick), class: "gpu-check" });
    const price = el("input", {
      type: "number", min: "0", step: "0.01", inputmode: "decimal", class: "gpu-price",
      id: `${id}-price`, value: pick ? pick.price : "", placeholder: "price / h",
      "aria-label": `${label} price per GPU-hour`, hidden: !pick,
    });
    box.addEventListener("change", () => {
      const next = page.state.gpus.filter((x) => x.name !== key);
      if (box.checked) next.push(gpuEntry(key, ""));
      setChosenGpus(next);
      price.hidden = !box.checked;
      changed();
    });
    price.addEventListener("input", () => {
      const entry = page.state.gpus.find((x) => x.name === key);
      if (entry) entry.price = price.value;
      changed();
    });
    return el(
      "div",
      { class: "gpu-row" },
      box,
      el("label", { for: id }, el("span", { class: "gpu-name", text: label }), el("span", { class: "gpu-mem", text: memText })),
      price,
    );
  }

  // "Add": a GPU by the memory nvidia-smi reports; the API says which catalog GPU matches it.
  function addGpuBySize() {
    const input = $("gpu-memory");
    const mib = Number(input.value);
    const valid = Number.isInteger(mib) && MEMORY_GPU.test(`${mib}MiB`);
    input.setAttribute("aria-invalid", valid ? "false" : "true");
    $("gpu-memory-hint").textContent = valid
      ? "The total memory nvidia-smi reports, in MiB (an RTX 4090: 24564)."
      : "Enter a whole number of MiB, 1 or more (an RTX 4090: 24564).";
    if (!valid) return;
    const key = `${mib}MiB`;
    if (!page.state.gpus.some((g) => g.name === key)) setChosenGpus([...page.state.gpus, gpuEntry(key, "")]);
    input.value = "";
    renderGpuList();
    changed();
  }

  // ------------------------------------------------------------------------------------------
  // More options: fields from the schema (JobSpec and the sections in MORE_SECTIONS)

  function resolveSchema(node, schemas) {
    const ref = node && node.$ref;
    return ref ? schemas[ref.split("/").pop()] || {} : node || {};
  }

  // A field the page can edit: a flag, a number, a string or a choice; null for the rest
  // (objects, lists, a choice of shapes).
  function moreField(path, node, schemas) {
    const options = (node.anyOf || [node]).map((o) => resolveSchema(o, schemas));
    const typed = options.filter((o) => o.type !== "null");
    const field = {
      path,
      name: path.split(".").pop(),
      description: node.description || typed[0]?.description || "",
      fallback: node.default,
      nullable: typed.length < options.length,
    };
    const named = typed.find((o) => Array.isArray(o.enum));
    if (named) return { ...field, kind: "choice", choices: named.enum.map(String) };
    if (typed.length !== 1) return null;
    const only = typed[0];
    if (only.type === "boolean" && field.nullable) {
      return { ...field, kind: "choice", choices: ["true", "false"], flag: true };
    }
    if (only.type === "boolean") return { ...field, kind: "boolean" };
    if (only.type === "integer" || only.type === "number") {
      return { ...field, kind: only.type, min: only.minimum, max: only.maximum };
    }
    if (only.type === "string") return { ...field, kind: "string", maxLength: only.maxLength };
    return null;
  }

  function moreFields(openapi) {
    const schemas = openapi?.components?.schemas;
    const job = schemas?.JobSpec;
    if (!job) return [];
    const fields = [];
    const walk = (prefix, properties) => {
      for (const [name, node] of Object.entries(properties || {})) {
        const path = prefix ? `${prefix}.${name}` : name;
        if (HAND_LAID.has(path) || (!prefix && MORE_SECTIONS.includes(name))) continue;
        const field = moreField(path, node, schemas);
        if (field) fields.push(field);
      }
    };
    walk("", job.properties);
    for (const section of MORE_SECTIONS) {
      const node = job.properties[section];
      if (!node) continue;
      const object = (node.anyOf || [node]).map((o) => resolveSchema(o, schemas)).find((o) => o.properties);
      if (object) walk(section, object.properties);
    }
    return fields;
  }

  function moreInput(field) {
    const id = `more-${field.path.replace(/\./g, "-")}`;
    const common = { id, name: field.path, title: field.description || null };
    if (field.kind === "boolean") {
      const box = el("input", { ...common, type: "checkbox" });
      return el("div", { class: "field check" }, el("label", {}, box, ` ${field.name}`));
    }
    const hintId = `${id}-hint`;
    let input;
    if (field.kind === "choice") {
      const blank = field.fallback === undefined || field.fallback === null;
      input = el(
        "select",
        { ...common, "aria-describedby": hintId },
        blank ? el("option", { value: "", text: "default" }) : null,
        ...field.choices.map((c) => el("option", { value: c, text: c })),
      );
    } else {
      const numeric = field.kind !== "string";
      input = el("input", {
        ...common,
        type: numeric ? "number" : "text",
        min: numeric ? field.min : null,
        max: numeric ? field.max : null,
        step: field.kind === "integer" ? "1" : numeric ? "any" : null,
        maxlength: field.maxLength,
        inputmode: field.kind === "integer" ? "numeric" : null,
        placeholder: field.fallback === undefined || field.fallback === null ? "default" : null,
        spellcheck: numeric ? null : "false",
        "aria-describedby": hintId,
      });
    }
    return el(
      "div",
      { class: "field" },
      el("label", { for: id, text: field.name }),
      input,
      el("p", { id: hintId, class: "hint", text: field.description }),
    );
  }

  // The More options section, one group per section, from the document at /openapi.json.
  function renderMoreOptions(openapi) {
    page.more = moreFields(openapi);
    page.moreByPath = new Map(page.more.map((f) => [f.path, f]));
    const host = $("more-fields");
    host.replaceChildren();
    const groups = new Map();
    for (const field of page.more) {
      const section = field.path.includes(".") ? field.path.split(".")[0] : "job";
      if (!groups.has(section)) {
        const grid = el("div", { class: "grid-2" });
        groups.set(section, grid);
        host.append(el("fieldset", {}, el("legend", { text: section }), grid));
      }
      groups.get(section).append(moreInput(field));
    }
    $("more-options").hidden = page.more.length === 0;
  }

  // The text a field's default shows as (booleans as the link writes them).
  function moreDefault(field) {
    if (field.fallback === undefined || field.fallback === null) return "";
    if (field.kind === "boolean") return field.fallback ? "1" : "0";
    return String(field.fallback);
  }

  // The values set, as the link keeps them: fields left at their default are left out.
  function readMoreOptions() {
    const values = {};
    for (const field of page.more) {
      const input = form.elements[field.path];
      if (!input) continue;
      const raw = field.kind === "boolean" ? (input.checked ? "1" : "0") : input.value.trim();
      if (raw !== "" && raw !== moreDefault(field)) values[field.path] = raw;
    }
    return values;
  }

  function writeMoreOptions(values) {
    let given = false;
    for (const field of page.more) {
      const input = form.elements[field.path];
      if (!input) continue;
      const raw = values?.[field.path];
      given = given || raw !== undefined;
      const shown = raw === undefined ? moreDefault(field) : raw;
      if (field.kind === "boolean") input.checked = shown === "1" || shown === "true";
      else input.value = shown;
    }
    if (given) $("more-options").open = true;
  }

  // The value a field's text stands for in the request.
  function moreValue(field, raw) {
    if (field.kind === "boolean") return raw === "1" || raw === "true";
    if (field.flag) return raw === "true";
    if (field.kind === "integer" || field.kind === "number") {
      const n = Number(raw);
      if (!Number.isFinite(n)) throw new FormError(field.path, `${field.path}: ${raw} is not a number`);
      return n;
    }
    return raw;
  }

  function addMoreOptions(job, values) {
    for (const [path, raw] of Object.entries(values || {})) {
      const field = page.moreByPath.get(path);
      if (!field) continue;
      const parts = path.split(".");
      let target = job;
      for (const part of parts.slice(0, -1)) {
        if (!target[part] || typeof target[part] !== "object") target[part] = {};
        target = target[part];
      }
      target[parts[parts.length - 1]] = moreValue(field, raw);
    }
  }

  // A suggestion's change to a field of the More options (or to one of a section's).
  function setMoreOptions(values, key, value) {
    const entries = value && typeof value === "object" && !Array.isArray(value)
      ? Object.entries(value).map(([sub, v]) => [`${key}.${sub}`, v])
      : [[key, value]];
    for (const [path, v] of entries) {
      const field = page.moreByPath.get(path);
      if (!field) continue;
      const raw = v === null ? "" : field.kind === "boolean" ? (v ? "1" : "0") : String(v);
      if (raw === "" || raw === moreDefault(field)) delete values[path];
      else values[path] = raw;
    }
  }

  // ------------------------------------------------------------------------------------------
  // Start

  function renderTableHeads() {
    for (const [id, columns] of Object.entries(TABLE_COLUMNS)) {
      const heads = columns.map(([text, numeric]) =>
        el("th", { role: "columnheader", scope: "col", class: numeric ? "num" : null, text }));
      $(id).tHead.replaceChildren(el("tr", { role: "row" }, ...heads));
    }
  }

  function wire() {
    renderTableHeads();
    form.addEventListener("submit", (e) => e.preventDefault());
    form.addEventListener("input", (e) => {
      if (e.target.classList.contains("gpu-check") || e.target.classList.contains("gpu-price")) return;
      if (e.target.id === "model-search") return renderModelOptions();
      if (e.target.id === "gpu-search") return renderGpuList();
      if (e.target.id === "gpu-memory") return;
      if (e.target.id === "share-link") return;
      changed();
    });
    $("add-gpu-memory").addEventListener("click", addGpuBySize);
    $("gpu-memory").addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        addGpuBySize();
      }
    });
    $("copy-link").addEventListener("click", async () => {
      const link = $("share-link");
      let copied = false;
      try {
        await navigator.clipboard.writeText(link.value);
        copied = true;
      } catch {
        link.select();
        copied = document.execCommand && document.execCommand("copy");
      }
      $("copy-status").textContent = copied ? "Link copied." : "Select the link and copy it.";
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(renderCurves, 100);
    });
  }

  async function start() {
    wire();
    setPageState("loading");
    try {
      const schema = api(OPENAPI).catch(() => null); // without it, no More options
      const [models, gpus, openapi] = await Promise.all([api(API.models), api(API.gpus), schema]);
      page.models = models.models;
      page.gpus = gpus.gpus;
      renderMoreOptions(openapi);
    } catch (err) {
      showError(err);
      setPageState("error");
      return;
    }
    const fromUrl = stateFromUrl(location.search);
    const known = new Set(page.gpus.map((g) => g.name));
    if (!fromUrl.model) {
      const ids = page.models.map((m) => m.id);
      fromUrl.model = ids.includes(PREFERRED_MODEL) ? PREFERRED_MODEL : ids[0] || "";
    }
    if (fromUrl.gpus !== null) fromUrl.gpus = fromUrl.gpus.filter((g) => g.memory_mib || known.has(g.name));
    if (fromUrl.gpus === null) {
      fromUrl.gpus = PREFERRED_GPUS.filter((n) => known.has(n)).map((name) => ({ name, price: "" }));
    }
    page.state = fromUrl;
    renderModelOptions();
    writeForm(page.state);
    changed();
  }

  start();
})();
