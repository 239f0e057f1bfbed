// Everything the page shows, read from the DOM in one call: bytes from data-bytes, text as shown.
() => {
  const q = (selector, root = document) => root.querySelector(selector);
  const qa = (selector, root = document) => [...root.querySelectorAll(selector)];
  const text = (node) => (node ? node.textContent.trim() : null);
  const bytes = (node) => (node && node.dataset.bytes !== undefined ? Number(node.dataset.bytes) : null);
  const shown = (node) => ({ bytes: bytes(node), text: text(node) });
  const curve = (id) => ({
    points: qa(`#${id} tbody tr`).map((tr) => ({ x: Number(tr.dataset.x), bytes: Number(tr.dataset.bytes) })),
    own: q(`#${id} tbody tr.own`) ? Number(q(`#${id} tbody tr.own`).dataset.x) : null,
    ownCx: q(`#${id} circle.own-point`) ? q(`#${id} circle.own-point`).getAttribute("cx") : null,
    marks: Object.fromEntries(qa(`#${id} circle.fit-mark`).map((m) => [m.dataset.gpu, Number(m.dataset.x)])),
    keys: Object.fromEntries(qa(`#${id} li.gpu-key`).map((k) => [k.dataset.gpu, Number(k.dataset.max)])),
  });
  const phase = q("#peak-phase");
  return {
    levels: {
      allocated: shown(q("#peak-allocated")),
      reserved: shown(q("#peak-reserved")),
      device: shown(q("#peak-device")),
      safe: shown(q("#peak-safe")),
    },
    phase: { text: text(phase), key: phase.dataset.phase || null },
    legend: qa("#breakdown-legend li[data-bytes]").map((li) => ({
      key: li.dataset.component,
      bytes: Number(li.dataset.bytes),
      text: text(q(".legend-value", li)),
    })),
    margin: shown(q('#breakdown-legend li[data-component="safe_margin"] .legend-value')),
    marginLabel: text(q('#breakdown-legend li[data-component="safe_margin"] .legend-label')),
    levelLabels: qa("#breakdown-chart text.level-label").map(text),
    calibration: {
      ...Object.fromEntries(
        ["applied", "scope", "factor", "samples", "nodes"].map((k) => [k, text(q(`#calibration-${k}`))]),
      ),
      levels: qa("#calibration-levels tbody tr").map((tr) => {
        const [level, scope, factor, samples, nodes] = qa("th, td", tr).map(text);
        return { level, scope, factor, samples, nodes };
      }),
      state: q("#calibration-state") ? q("#calibration-state").dataset.state : null,
    },
    fit: qa("#fit-table tbody tr").map((tr) => ({
      gpu: tr.dataset.gpu,
      label: text(q("th", tr)),
      fits: tr.dataset.fits === "true",
      fitsText: text(q("td.fits", tr)),
      usable: shown(q("td.usable", tr)),
      headroom: shown(q("td.headroom", tr)),
      maxBatch: text(q("td.max-batch", tr)),
      maxSeq: text(q("td.max-seq", tr)),
      cost: text(q("td.cost", tr)),
      cheapest: tr.classList.contains("cheapest"),
    })),
    suggestions: Object.fromEntries(
      qa(".suggestion-group").map((group) => [
        group.dataset.gpu,
        qa("li.suggestion", group).map((li) => ({
          bytes: Number(li.dataset.bytes),
          fits: li.dataset.fits === "true",
          set: JSON.parse(li.dataset.set),
          text: text(li),
        })),
      ]),
    ),
    placement: q("#placement-section").hidden
      ? null
      : qa("#placement-table tbody tr").map((tr) => ({
          gpu: tr.dataset.gpu,
          strategy: tr.dataset.strategy,
          outcome: tr.dataset.outcome,
          count: q("td.count", tr) ? q("td.count", tr).firstChild.textContent : null,
          badges: qa(".badge", tr).map(text),
          nodes: text(q("td.nodes", tr)),
          perGpu: q("td.per-gpu", tr) ? shown(q("td.per-gpu", tr)) : null,
          cost: q("td.cost", tr) ? q("td.cost", tr).firstChild.textContent : null,
          reason: text(q("td.reason", tr)),
          cheapest: tr.classList.contains("cheapest"),
        })),
    curves: { batch: curve("batch-chart"), seq: curve("seq-chart") },
  };
}
