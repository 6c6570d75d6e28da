/* probe report: overview grids and head explorers drawn on canvas from inline, deflated data.
 * No network, no libraries: data comes from JSON script blocks (type application/json, read with
 * textContent + JSON.parse, never evaluated) and is inflated with the browser's
 * DecompressionStream("deflate"). Every model string reaches the page through textContent. */
(function () {
  "use strict";
  const probe = (window.probe = window.probe || {});

  probe.bytes = function (b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  };
  probe.inflate = async function (b64) {
    const stream = new Blob([probe.bytes(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  };
  probe.download = function (canvas, name) {
    canvas.toBlob(function (blob) {
      const a = document.createElement("a");
      a.href = URL.createObjectURL(blob);
      a.download = name;
      document.body.appendChild(a);
      a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 2000);
    }, "image/png");
  };
  // A figure's "Download PNG" link takes its figure's image when the page loads, so the file
  // holds each image once.
  document.querySelectorAll("a.probe-download[data-from-img]").forEach(function (a) {
    const img = a.closest("figure").querySelector("img");
    if (img) a.href = img.src;
  });
  probe.safeName = function (s) { return String(s).replace(/[^A-Za-z0-9._-]+/g, "_"); };

  // Max over the adaptive blocks torch.nn.functional.adaptive_max_pool2d uses (same thumbnails as Python).
  function pool(vals, nq, nk, tq, tk) {
    if (tq === nq && tk === nk) return vals;
    const out = new vals.constructor(tq * tk);
    for (let i = 0; i < tq; i++) {
      const q0 = Math.floor((i * nq) / tq), q1 = Math.ceil(((i + 1) * nq) / tq);
      for (let j = 0; j < tk; j++) {
        const k0 = Math.floor((j * nk) / tk), k1 = Math.ceil(((j + 1) * nk) / tk);
        let m = 0;
        for (let q = q0; q < q1; q++) {
          const row = q * nk;
          for (let k = k0; k < k1; k++) if (vals[row + k] > m) m = vals[row + k];
        }
        out[i * tk + j] = m;
      }
    }
    return out;
  }
  function blockRange(i, n, t) { return [Math.floor((i * n) / t), Math.ceil(((i + 1) * n) / t) - 1]; }
  // Labels longer than this are shortened with an ellipsis (figures do the same).
  const LABEL_CHARS = 12;
  function shortLabel(t) { const c = Array.from(t); return c.length > LABEL_CHARS ? c.slice(0, LABEL_CHARS - 1).join("") + "\u2026" : t; }
  let measurer = null;
  function textWidth(text, px) {
    measurer = measurer || document.createElement("canvas").getContext("2d");
    measurer.font = px + 'px ui-monospace, "DejaVu Sans Mono", "Noto Sans Mono CJK SC", monospace';
    return measurer.measureText(text).width;
  }

  class AttnView {
    constructor(root) {
      this.root = root;
      const data = JSON.parse(root.querySelector("script.probe-data").textContent);
      this.data = data;
      this.scale = data.scale;
      const hex = data.lut;
      this.lut = new Uint8Array(hex.length / 2);
      for (let i = 0; i < this.lut.length; i++) this.lut[i] = parseInt(hex.substr(2 * i, 2), 16);
      this.gamma = 1;
      this.decoded = new Map();
      this.el = (sel) => root.querySelector(sel);
      this.tooltip = this.el(".probe-tooltip");
      this.si = 0; this.li = 0; this.hi = 0; this.q = 0; this.k = 0;
      const selSet = this.el(".sel-set");
      data.sets.forEach((s, i) => selSet.add(new Option(s.label, String(i))));
      selSet.addEventListener("change", () => this.selectSet(+selSet.value));
      this.el(".sel-gamma").addEventListener("change", (e) => { this.gamma = +e.target.value; this.drawAll(); this.drawScales(); });
      this.el(".sel-layer").addEventListener("change", (e) => this.selectHead(+e.target.value, this.hi));
      this.el(".sel-head").addEventListener("change", (e) => this.selectHead(this.li, +e.target.value));
      this.el(".btn-png-overview").addEventListener("click", () => this.downloadOverview());
      this.el(".btn-png-head").addEventListener("click", () => this.downloadHead());
      this.bindMatrix();
      this.bindOverview();
      this.bindTokens();
      this.drawScales();
      this.ready = this.selectSet(0);
    }

    // The colour of weight w (0..1) under the current scale: what every cell of this view uses.
    colourOf(w) {
      let x = Math.min(1, Math.max(0, w));
      if (this.gamma !== 1) x = Math.pow(x, this.gamma);
      const c = 3 * Math.min(255, Math.max(0, Math.round(x * 255)));
      return [this.lut[c], this.lut[c + 1], this.lut[c + 2]];
    }

    // Colour bars (one above the overview, one above the explorer): weight 0 to 1 left to right,
    // with ticks at round weights, placed where the current scale (linear / square root) puts them.
    drawScales() {
      this.root.querySelectorAll(".probe-colorbar").forEach((cv) => {
        const ctx = cv.getContext("2d"), w = cv.width, bar = 14, left = 6, right = w - 6;
        ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, w, cv.height);
        for (let x = left; x < right; x++) {
          const weight = Math.pow((x - left + 0.5) / (right - left), 1 / this.gamma);
          const [r, g, b] = this.colourOf(weight);
          ctx.fillStyle = "rgb(" + r + "," + g + "," + b + ")";
          ctx.fillRect(x, 0, 1, bar);
        }
        ctx.fillStyle = "#333"; ctx.font = "11px sans-serif"; ctx.textBaseline = "top";
        const ticks = this.gamma === 1 ? [0, 0.25, 0.5, 0.75, 1] : [0, 0.05, 0.25, 0.5, 1];
        ticks.forEach((t) => {
          const x = left + Math.pow(t, this.gamma) * (right - left);
          ctx.fillRect(Math.round(x) - (t === 1 ? 1 : 0), bar, 1, 4);
          const label = String(t);
          const tw = ctx.measureText(label).width;
          ctx.fillText(label, Math.min(Math.max(0, x - tw / 2), w - tw), bar + 5);
        });
      });
      this.root.querySelectorAll(".probe-colorbar-label").forEach((e) => {
        e.textContent = "attention weight, " + (this.gamma === 1 ? "linear scale" : "square-root scale (faint weights brighter)");
      });
    }

    async decode(si) {
      if (!this.decoded.has(si)) {
        const s = this.data.sets[si];
        const p = (async () => {
          const raw = await probe.inflate(s.full);
          const full = this.data.bytes === 2 ? new Uint16Array(raw.buffer, raw.byteOffset, raw.length / 2) : raw;
          const thumbs = s.thumbs ? await probe.inflate(s.thumbs) : null;
          return { full, thumbs };
        })();
        this.decoded.set(si, p);
      }
      return this.decoded.get(si);
    }

    // Layers may have different heads (s.layerHeads: each layer's own, the model's numbers); the
    // overview's columns are s.heads, every number some layer has. The column indices (into
    // s.heads) of layer li's heads, and where each layer's heads start in the packed data.
    layout(s) {
      if (!s._cols) {
        const own = s.layerHeads || s.layers.map(() => s.heads);
        s._cols = own.map((hs) => hs.map((h) => s.heads.indexOf(h)));
        s._start = [];
        own.reduce((n, hs, li) => { s._start[li] = n; return n + hs.length; }, 0);
      }
      return s;
    }

    // Whether layer li has the head of column hi (a layer with fewer heads leaves columns empty).
    hasHead(li, hi) { return this.layout(this.set)._cols[li].includes(hi); }

    // The matrix of head (li, hi): exact quantised weights, or a max-pooled thumbnail (exact: false);
    // null where layer li has no such head.
    matrix(li, hi) {
      const s = this.layout(this.set), d = this.dec, j = s._cols[li].indexOf(hi);
      if (j < 0) return null;
      const idx = s._start[li] + j;
      if (idx < s.nFull) {
        const n = s.nq * s.nk;
        return { vals: d.full.subarray(idx * n, (idx + 1) * n), nq: s.nq, nk: s.nk, scale: this.scale, exact: true };
      }
      const n = s.tq * s.tk, t = idx - s.nFull;
      return { vals: d.thumbs.subarray(t * n, (t + 1) * n), nq: s.tq, nk: s.tk, scale: 255, exact: false };
    }

    // A colour per stored value (256 or 65536 entries, RGBA as one 32-bit word): one lookup per pixel.
    lut32(scale) {
      const key = scale + ":" + this.gamma;
      this._luts = this._luts || new Map();
      if (!this._luts.has(key)) {
        const out = new Uint32Array(scale + 1), rgba = new Uint8Array(out.buffer), lut = this.lut, g = this.gamma;
        for (let v = 0; v <= scale; v++) {
          let x = v / scale;
          if (g !== 1) x = Math.pow(x, g);
          const c = 3 * Math.min(255, Math.max(0, Math.round(x * 255)));
          rgba[4 * v] = lut[c]; rgba[4 * v + 1] = lut[c + 1]; rgba[4 * v + 2] = lut[c + 2]; rgba[4 * v + 3] = 255;
        }
        this._luts.set(key, out);
      }
      return this._luts.get(key);
    }

    paint(m, vals, w, h) {
      const img = new ImageData(w, h), px = new Uint32Array(img.data.buffer), lut = this.lut32(m.scale);
      for (let i = 0; i < w * h; i++) px[i] = lut[vals[i]];
      return img;
    }

    async selectSet(si) {
      this.si = si;
      this.set = this.data.sets[si];
      this.dec = await this.decode(si);
      const s = this.set;
      const selL = this.el(".sel-layer"), selH = this.el(".sel-head");
      selL.textContent = ""; selH.textContent = "";
      s.layers.forEach((l, i) => selL.add(new Option(String(l), String(i))));
      this.headsOf = -1;
      const own = this.layout(s)._cols.map((c) => c.length);
      const note = this.el(".overview-missing");
      if (note) {
        note.hidden = own.every((n) => n === s.heads.length);
        note.textContent = note.hidden ? "" : "Layers differ in their heads (" +
          s.layers.map((l, i) => "L" + l + ": " + own[i]).join(", ") +
          "): a hatched cell is a head its layer does not have; the explorer offers each layer's own heads.";
      }
      this.fillTokens(this.el(".tokens-q"), s.qTokens);
      this.fillTokens(this.el(".tokens-k"), s.kTokens);
      this.q = 0; this.k = 0;
      this.drawOverview();
      this.selectHead(0, 0);
    }

    drawAll() { this.drawOverview(); this.drawHead(); }

    fillTokens(box, toks) {
      box.textContent = "";
      const frag = document.createDocumentFragment();
      toks.forEach((t, i) => {
        const span = document.createElement("span");
        span.className = "tok";
        span.textContent = t;
        span.dataset.i = String(i);
        span.title = "position " + i + (t.length > LABEL_CHARS ? ": " + t : "");
        frag.appendChild(span);
      });
      box.appendChild(frag);
    }

    // ---- overview ---------------------------------------------------------------------------
    overviewLayout() {
      const s = this.set;
      const tq = Math.min(s.nq, 64), tk = Math.min(s.nk, 64);
      const z = Math.max(1, Math.ceil(48 / Math.max(tq, tk)));
      return { tq, tk, cw: tk * z, ch: tq * z, gap: 4, left: 36, top: 18 };
    }

    // An empty, hatched cell: a head this layer does not have (nothing is drawn as if it existed).
    drawMissing(ctx, x, y, w, h) {
      ctx.save();
      ctx.fillStyle = "#f2f2f2"; ctx.fillRect(x, y, w, h);
      ctx.beginPath(); ctx.rect(x, y, w, h); ctx.clip();
      ctx.strokeStyle = "#c8c8c8"; ctx.lineWidth = 1;
      for (let t = -h; t < w; t += 8) { ctx.moveTo(x + t, y + h); ctx.lineTo(x + t + h, y); }
      ctx.stroke();
      ctx.restore();
    }

    drawOverview() {
      const s = this.set, L = this.overviewLayout(), cv = this.el(".probe-overview");
      const nL = s.layers.length, nH = s.heads.length;
      cv.width = L.left + nH * (L.cw + L.gap);
      cv.height = L.top + nL * (L.ch + L.gap);
      const ctx = cv.getContext("2d");
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
      ctx.fillStyle = "#333"; ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
      const tmp = document.createElement("canvas");
      for (let hi = 0; hi < nH; hi++) ctx.fillText("H" + s.heads[hi], L.left + hi * (L.cw + L.gap) + 2, 8);
      for (let li = 0; li < nL; li++) {
        ctx.fillText("L" + s.layers[li], 2, L.top + li * (L.ch + L.gap) + L.ch / 2);
        for (let hi = 0; hi < nH; hi++) {
          const m = this.matrix(li, hi);
          if (!m) {
            this.drawMissing(ctx, L.left + hi * (L.cw + L.gap), L.top + li * (L.ch + L.gap), L.cw, L.ch);
            continue;
          }
          const tq = Math.min(m.nq, L.tq), tk = Math.min(m.nk, L.tk);
          const vals = pool(m.vals, m.nq, m.nk, tq, tk);
          tmp.width = tk; tmp.height = tq;
          tmp.getContext("2d").putImageData(this.paint(m, vals, tk, tq), 0, 0);
          ctx.imageSmoothingEnabled = false;
          ctx.drawImage(tmp, L.left + hi * (L.cw + L.gap), L.top + li * (L.ch + L.gap), L.cw, L.ch);
        }
      }
    }

    overviewCell(ev) {
      const cv = this.el(".probe-overview"), r = cv.getBoundingClientRect(), L = this.overviewLayout();
      const x = ((ev.clientX - r.left) * cv.width) / r.width - L.left, y = ((ev.clientY - r.top) * cv.height) / r.height - L.top;
      const hi = Math.floor(x / (L.cw + L.gap)), li = Math.floor(y / (L.ch + L.gap));
      if (x < 0 || y < 0 || hi >= this.set.heads.length || li >= this.set.layers.length) return null;
      return [li, hi];
    }

    bindOverview() {
      const cv = this.el(".probe-overview");
      cv.addEventListener("mousemove", (ev) => {
        const c = this.overviewCell(ev);
        if (!c) return this.hideTip();
        const m = this.matrix(c[0], c[1]), where = "Layer " + this.set.layers[c[0]];
        if (!m) {
          const n = this.layout(this.set)._cols[c[0]].length;
          return this.showTip(ev, where + " has no head " + this.set.heads[c[1]] + " (it has " + n + (n === 1 ? " head)" : " heads)"));
        }
        this.showTip(ev, where + ", Head " + this.set.heads[c[1]] + (m.exact ? "" : " (max-pooled)") + "\nclick to explore");
      });
      cv.addEventListener("mouseleave", () => this.hideTip());
      cv.addEventListener("click", (ev) => {
        const c = this.overviewCell(ev);
        if (!c || !this.hasHead(c[0], c[1])) return;
        this.selectHead(c[0], c[1]);
        this.el(".probe-matrix").focus({ preventScroll: true });
        this.el(".probe-matrix").scrollIntoView({ block: "nearest" });
      });
    }

    downloadOverview() {
      probe.download(this.el(".probe-overview"), probe.safeName("overview_" + this.set.label) + ".png");
    }

    // ---- explorer ---------------------------------------------------------------------------
    // Layer li (clamped) and its head of column hi, or where the layer lacks it, the layer's nearest
    // head below (else its first). The head selector offers the layer's own heads only.
    selectHead(li, hi) {
      const s = this.layout(this.set);
      this.li = Math.max(0, Math.min(s.layers.length - 1, li));
      const cols = s._cols[this.li], below = cols.filter((c) => c <= hi);
      this.hi = cols.includes(hi) ? hi : below.length ? below[below.length - 1] : cols[0];
      const selH = this.el(".sel-head");
      if (this.headsOf !== this.li) {
        selH.textContent = "";
        cols.forEach((c) => selH.add(new Option(String(s.heads[c]), String(c))));
        this.headsOf = this.li;
      }
      this.el(".sel-layer").value = String(this.li);
      selH.value = String(this.hi);
      this.drawHead();
    }

    // The layer's next (d = 1) or previous (d = -1) head of its own.
    stepHead(d) {
      const cols = this.layout(this.set)._cols[this.li], i = cols.indexOf(this.hi) + d;
      this.selectHead(this.li, cols[Math.max(0, Math.min(cols.length - 1, i))]);
    }

    drawHead() {
      const m = (this.cur = this.matrix(this.li, this.hi)), cv = this.el(".probe-matrix");
      cv.width = m.nk; cv.height = m.nq;
      cv.getContext("2d").putImageData(this.paint(m, m.vals, m.nk, m.nq), 0, 0);
      // cells of a whole pixel each, the matrix within 640 px and (with its labels) the window
      const room = Math.min(640, Math.max(200, window.innerHeight * 0.8 - 90));
      // at most 40 px a cell: a 5-token sentence stays a compact figure, not a 600 px wall
      const z = Math.max(1, Math.min(40, Math.floor(room / Math.max(m.nq, m.nk))));
      this.zoom = z;
      cv.style.width = m.nk * z + "px"; cv.style.height = m.nq * z + "px";
      const note = this.el(".explorer-note");
      note.hidden = m.exact;
      note.textContent = m.exact ? "" : "Layer " + this.set.layers[this.li] + ", Head " + this.set.heads[this.hi] +
        " is not embedded at full resolution (the page's budget holds " + this.set.nFull +
        " heads of this pattern): shown max-pooled to " + m.nq + " x " + m.nk + "; values are block maxima.";
      this.q = Math.min(this.q, this.set.nq - 1); this.k = Math.min(this.k, this.set.nk - 1);
      this.axisLabels(m, z);
      this.el(".strip-row").style.marginLeft = this.pad[0] + "px";
      this.el(".strip-col").style.marginLeft = this.pad[0] + "px";
      this.el(".strip-row").width = this.set.nk * (m.exact ? z : 1);
      this.el(".strip-col").width = this.set.nq * (m.exact ? z : 1);
      this.focusCell(this.q, this.k, null);
    }

    // Token labels beside rows (queries) and above columns (keys) when cells are big enough to read.
    // The margins fit the longest label (measured, up to 12 characters, the rest in its tooltip, as
    // in figures); key labels run top to bottom with CJK characters upright (vertical writing).
    axisLabels(m, z) {
      const wrap = this.el(".probe-canvas-wrap"), s = this.set;
      wrap.querySelectorAll(".axis-label").forEach((e) => e.remove());
      const show = m.exact && z >= 10;
      const fs = Math.min(13, z - 2);
      const qShown = s.qTokens.map(shortLabel), kShown = s.kTokens.map(shortLabel);
      const longest = (labels) => Math.max(0, ...labels.map((t) => textWidth(t, fs)));
      const padL = show ? Math.ceil(Math.max(70, longest(qShown) + 10)) : 0;
      const padT = show ? Math.ceil(Math.max(40, longest(kShown) + 10)) : 0;
      wrap.style.paddingLeft = padL + "px"; wrap.style.paddingTop = padT + "px";
      this.pad = [padL, padT];
      if (!show) return;
      const frag = document.createDocumentFragment();
      const label = (text, full, cls, css) => {
        const e = document.createElement("span");
        e.className = "axis-label tok " + cls;
        e.textContent = text;
        if (full !== text) e.title = full;
        Object.assign(e.style, css, { fontSize: fs + "px" });
        frag.appendChild(e);
      };
      qShown.forEach((t, q) => label(t, s.qTokens[q], "axis-q", { top: padT + q * z + "px", height: z + "px", width: padL - 4 + "px", left: "0px" }));
      // one-character keys stand upright (as figures leave them unrotated); longer ones run top to bottom
      const kCls = kShown.every((t) => Array.from(t).length <= 1) ? "axis-k axis-upright" : "axis-k";
      kShown.forEach((t, k) => label(t, s.kTokens[k], kCls, { left: padL + k * z + "px", width: z + "px", height: padT - 4 + "px", top: "0px" }));
      label("key \u2192", "key \u2192", "axis-corner", { left: "0px", top: Math.max(0, padT - 36) + "px", width: padL - 4 + "px", height: "16px" });
      label("query \u2193", "query \u2193", "axis-corner", { left: "0px", top: Math.max(16, padT - 18) + "px", width: padL - 4 + "px", height: "16px" });
      wrap.appendChild(frag);
    }

    // The exact weight of cell (q, k) in the current head, or a block's max when downsampled.
    cellText(q, k) {
      const m = this.cur, s = this.set, step = 1 / m.scale, dec = m.scale > 255 ? 6 : 4;
      if (m.exact) {
        const w = m.vals[q * m.nk + k] / m.scale;
        return "query " + q + " \u201c" + s.qTokens[q] + "\u201d \u2192 key " + k + " \u201c" + s.kTokens[k] +
          "\u201d\nweight " + w.toFixed(dec) + " (\u00b1" + (step / 2).toPrecision(2) + ")";
      }
      const i = Math.floor((q * m.nq) / s.nq), j = Math.floor((k * m.nk) / s.nk);
      const [q0, q1] = blockRange(i, s.nq, m.nq), [k0, k1] = blockRange(j, s.nk, m.nk);
      return "queries " + q0 + "\u2013" + q1 + " \u00d7 keys " + k0 + "\u2013" + k1 + "\nmax weight " +
        (m.vals[i * m.nk + j] / 255).toFixed(4) + " (downsampled)";
    }

    focusCell(q, k, ev) {
      const s = this.set, m = this.cur;
      this.q = Math.max(0, Math.min(s.nq - 1, q));
      this.k = Math.max(0, Math.min(s.nk - 1, k));
      const text = this.cellText(this.q, this.k);
      const ro = this.el(".probe-readout");
      ro.textContent = "Layer " + s.layers[this.li] + ", Head " + s.heads[this.hi] + ": " + text;
      ro.dataset.q = String(this.q); ro.dataset.k = String(this.k);
      if (ev) this.showTip(ev, text);
      // bands over the displayed matrix (CSS pixels)
      const cv = this.el(".probe-matrix"), zx = cv.clientWidth / s.nk, zy = cv.clientHeight / s.nq;
      const [px, py] = this.pad || [0, 0];
      // outlines around the row, the column and the cell (their insides stay transparent, so the
      // colours under them are the weights' own)
      this.band(".band-row", px - 1, py + this.q * zy - 1, cv.clientWidth + 2, Math.max(1, zy) + 2);
      this.band(".band-col", px + this.k * zx - 1, py - 1, Math.max(1, zx) + 2, cv.clientHeight + 2);
      this.band(".band-cell", px + this.k * zx - 2, py + this.q * zy - 2, Math.max(1, zx) + 4, Math.max(1, zy) + 4);
      this.markToken(".tokens-q", "q", this.q);
      this.markToken(".tokens-k", "k", this.k);
      this.drawStrips(m);
    }

    band(sel, x, y, w, h) {
      const b = this.el(sel);
      b.hidden = false;
      b.style.left = x + "px"; b.style.top = y + "px"; b.style.width = w + "px"; b.style.height = h + "px";
    }

    markToken(sel, cls, i) {
      const box = this.el(sel), key = "_marked_" + cls;
      if (this[key]) this[key].classList.remove(cls);
      const span = box.children[i];
      if (span) span.classList.add(cls);
      this[key] = span;
    }

    drawStrips(m) {
      const s = this.set;
      const rowVals = [], colVals = [];
      if (m.exact) {
        for (let k = 0; k < s.nk; k++) rowVals.push(m.vals[this.q * m.nk + k] / m.scale);
        for (let q = 0; q < s.nq; q++) colVals.push(m.vals[q * m.nk + this.k] / m.scale);
      } else {
        const i = Math.floor((this.q * m.nq) / s.nq), j = Math.floor((this.k * m.nk) / s.nk);
        for (let k = 0; k < s.nk; k++) rowVals.push(m.vals[i * m.nk + Math.floor((k * m.nk) / s.nk)] / 255);
        for (let q = 0; q < s.nq; q++) colVals.push(m.vals[Math.floor((q * m.nq) / s.nq) * m.nk + j] / 255);
      }
      this.bars(this.el(".strip-row"), rowVals, this.k);
      this.bars(this.el(".strip-col"), colVals, this.q);
    }

    bars(cv, vals, mark) {
      const ctx = cv.getContext("2d"), w = cv.width / vals.length, h = cv.height;
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, h);
      for (let i = 0; i < vals.length; i++) {
        ctx.fillStyle = i === mark ? "#d9480f" : "#2b6cb0";
        const bh = vals[i] * (h - 2);
        ctx.fillRect(i * w, h - bh, Math.max(1, w - (w > 3 ? 1 : 0)), bh);
      }
    }

    bindMatrix() {
      const cv = this.el(".probe-matrix");
      cv.addEventListener("mousemove", (ev) => {
        const r = cv.getBoundingClientRect(), s = this.set;
        const k = Math.floor(((ev.clientX - r.left) / r.width) * s.nk);
        const q = Math.floor(((ev.clientY - r.top) / r.height) * s.nq);
        if (q < 0 || k < 0 || q >= s.nq || k >= s.nk) return;
        this.focusCell(q, k, ev);
      });
      cv.addEventListener("mouseleave", () => this.hideTip());
      cv.addEventListener("keydown", (ev) => {
        const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
        if (moves[ev.key]) {
          this.focusCell(this.q + moves[ev.key][0], this.k + moves[ev.key][1], null);
        } else if (ev.key === "[" || ev.key === "]") {
          this.stepHead(ev.key === "]" ? 1 : -1);
        } else if (ev.key === "PageUp" || ev.key === "PageDown") {
          this.selectHead(this.li + (ev.key === "PageDown" ? 1 : -1), this.hi);
        } else {
          return;
        }
        ev.preventDefault();
      });
    }

    bindTokens() {
      const on = (sel, fn) =>
        this.el(sel).addEventListener("mouseover", (ev) => {
          const t = ev.target.closest(".tok");
          if (t && t.dataset.i !== undefined) fn(+t.dataset.i);
        });
      on(".tokens-q", (i) => this.focusCell(i, this.k, null));
      on(".tokens-k", (i) => this.focusCell(this.q, i, null));
    }

    downloadHead() {
      const m = this.cur, s = this.set;
      const z = Math.max(1, Math.floor(768 / Math.max(m.nq, m.nk))), title = 24;
      const out = document.createElement("canvas");
      out.width = Math.max(m.nk * z, 240); out.height = m.nq * z + title;
      const ctx = out.getContext("2d");
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, out.width, out.height);
      ctx.fillStyle = "#111"; ctx.font = "14px sans-serif"; ctx.textBaseline = "middle";
      const name = "Layer " + s.layers[this.li] + ", Head " + s.heads[this.hi];
      ctx.fillText(name, 4, title / 2);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(this.el(".probe-matrix"), 0, title, m.nk * z, m.nq * z);
      probe.download(out, probe.safeName(s.label + "_" + name) + ".png");
    }

    showTip(ev, text) {
      const t = this.tooltip;
      t.textContent = text;
      t.style.display = "block";
      t.style.left = ev.clientX + 14 + "px";
      t.style.top = ev.clientY + 14 + "px";
    }
    hideTip() { this.tooltip.style.display = "none"; }
  }

  // Two views in one .probe-pair (two captures side by side) move in step: the same pattern set
  // (by its label), the same layer and head (by the model's numbers) and the same cell; the pair's
  // .probe-pair-delta line gives both weights of the cell and B - A.
  function pairViews() {
    document.querySelectorAll(".probe-pair").forEach((box) => {
      const views = probe.views.filter((v) => box.contains(v.root));
      if (views.length !== 2) return;
      let busy = false;
      const step = (fn) => { if (busy) return; busy = true; try { fn(); } finally { busy = false; } };
      const weight = (v) => (v.cur && v.cur.exact ? v.cur.vals[v.q * v.cur.nk + v.k] / v.cur.scale : null);
      const delta = () => {
        const [a, b] = views, line = box.parentNode.querySelector(".probe-pair-delta");
        if (!line || !a.cur || !b.cur) return;
        const wa = weight(a), wb = weight(b), err = 0.5 / a.cur.scale + 0.5 / b.cur.scale;
        const where = "Layer " + a.set.layers[a.li] + ", Head " + a.set.heads[a.hi] + ", query " + a.q + ", key " + a.k;
        const same = b.set.layers[b.li] === a.set.layers[a.li] && b.set.heads[b.hi] === a.set.heads[a.hi] && b.q === a.q && b.k === a.k;
        line.dataset.a = wa === null ? "" : String(wa); line.dataset.b = wb === null ? "" : String(wb);
        line.textContent = !same ? where + ": B has no such head or cell" : wa === null || wb === null
          ? where + ": not embedded at full resolution in both"
          : where + ": A " + wa.toFixed(4) + ", B " + wb.toFixed(4) + ", B \u2212 A " + (wb - wa).toFixed(4) + " (\u00b1" + err.toPrecision(2) + ")";
      };
      views.forEach((v, i) => {
        const o = views[1 - i];
        const selectHead = v.selectHead.bind(v), focusCell = v.focusCell.bind(v), selectSet = v.selectSet.bind(v);
        v.selectHead = (li, hi) => {
          selectHead(li, hi);
          step(() => {
            const ol = o.set.layers.indexOf(v.set.layers[v.li]), oh = o.set.heads.indexOf(v.set.heads[v.hi]);
            if (ol >= 0 && oh >= 0) o.selectHead(ol, oh);
          });
          delta();
        };
        v.focusCell = (q, k, ev) => { focusCell(q, k, ev); step(() => o.focusCell(v.q, v.k, null)); delta(); };
        v.selectSet = async (si) => {
          await selectSet(si);
          const j = o.data.sets.findIndex((s) => s.label === v.set.label);
          if (!busy && j >= 0 && j !== o.si) {
            busy = true;
            try { o.el(".sel-set").value = String(j); await o.selectSet(j); } finally { busy = false; }
          }
          delta();
        };
      });
      views[1].selectHead(views[0].li, views[0].hi);
    });
  }

  probe.views = [];
  probe.ready = Promise.all(
    Array.from(document.querySelectorAll(".probe-attn")).map((root) => {
      const v = new AttnView(root);
      probe.views.push(v);
      return v.ready;
    })
  ).then(() => { pairViews(); document.documentElement.dataset.probeReady = "1"; });
})();
