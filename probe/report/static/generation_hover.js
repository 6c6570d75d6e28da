/* probe report, "What the generated text read": hover (tap, or Tab to) a generated token to shade
 * every token it read by its weight: the prompt and the output before it (the generating stack),
 * or the source (an encoder-decoder's cross-attention). The rows come from the view's JSON block
 * (quantised per row, deflated, base64: see probe/report/sections/_generation_views.py), inflated
 * with report.js's probe.inflate; every model string reaches the page through textContent. */
(function () {
  "use strict";
  const TOP = 5; // keys the readout names

  class GenView {
    constructor(root, lut) {
      this.root = root;
      this.lut = lut;
      const d = (this.data = JSON.parse(root.querySelector("script.probe-data").textContent));
      this.K = d.keys.length;
      this.Q = d.mapped.length;
      this.row = new Map(d.mapped.map((t, i) => [t, i])); // generated token -> row of the blocks
      this.el = (sel) => root.querySelector(sel);
      this.blocks = new Map();
      this.li = d.layers.length - 1;
      this.head = -1; // -1: the mean over heads
      this.chips(); // the key chips and the generated tokens' chips
      this.step = d.mapped[d.mapped.length - 1];
      const selL = this.el(".sel-layer");
      d.layers.forEach((e, i) => selL.add(new Option(String(e.layer), String(i))));
      selL.value = String(this.li);
      selL.addEventListener("change", () => this.setLayer(+selL.value));
      this.el(".sel-head").addEventListener("change", (ev) => { this.head = +ev.target.value; this.show(); });
      this.fillHeads();
      this.bind();
      this.ready = this.show().then(() => { root.dataset.ready = "1"; });
    }

    chip(box, text, cls) {
      const s = document.createElement("span");
      s.className = "tok" + (cls ? " " + cls : "");
      s.textContent = text;
      box.appendChild(s);
      return s;
    }

    chips() {
      const d = this.data, keys = this.el(".probe-gen-keys");
      this.keyChips = d.keys.map((t, k) => this.chip(keys, t, d.kind === "self" && k >= d.nPrompt ? "gen" : ""));
      this.outChips = [];
      const outBox = d.kind === "self" ? keys : this.el(".probe-gen-out");
      d.out.forEach((t, i) => {
        const at = d.kind === "self" ? d.outKey[i] : -1;
        const c = at >= 0 ? this.keyChips[at] : this.chip(outBox, t, "gen");
        if (this.row.has(i)) { c.dataset.t = String(i); c.tabIndex = 0; }
        c.title = "generated token " + i + (this.row.has(i) ? "" : " (not mapped)");
        this.outChips.push(c);
      });
    }

    fillHeads() {
      const sel = this.el(".sel-head"), e = this.data.layers[this.li];
      sel.textContent = "";
      sel.add(new Option("mean over heads", "-1"));
      if (e.heads) e.heads.forEach((_, h) => sel.add(new Option("head " + h, String(h))));
      if (!e.heads || this.head >= e.heads.length) this.head = -1;
      sel.value = String(this.head);
      sel.disabled = !e.heads;
      sel.title = e.heads ? "" : "this layer's single heads are not embedded (the page's budget): the mean only";
    }

    setLayer(li) {
      this.li = Math.max(0, Math.min(this.data.layers.length - 1, li));
      this.el(".sel-layer").value = String(this.li);
      this.fillHeads();
      return this.show();
    }

    setHead(h) {
      const e = this.data.layers[this.li];
      if (!e.heads) return this.show();
      this.head = Math.max(-1, Math.min(e.heads.length - 1, h));
      this.el(".sel-head").value = String(this.head);
      return this.show();
    }

    setStep(t) {
      if (!this.row.has(t)) return Promise.resolve();
      this.step = t;
      return this.show();
    }

    // One layer's rows (the mean, or head h): {max, sum: Float32Array [Q], q: Uint8Array [Q * K]}.
    block(li, h) {
      const key = li + ":" + h;
      if (!this.blocks.has(key)) {
        const e = this.data.layers[li], Q = this.Q;
        this.blocks.set(key, window.probe.inflate(h < 0 ? e.mean : e.heads[h]).then((raw) => ({
          max: new Float32Array(raw.buffer, raw.byteOffset, Q),
          sum: new Float32Array(raw.buffer, raw.byteOffset + 4 * Q, Q),
          q: raw.subarray(8 * Q, 8 * Q + Q * this.K),
        })));
      }
      return this.blocks.get(key);
    }

    async show() {
      const ticket = (this.ticket = (this.ticket || 0) + 1);
      const b = await this.block(this.li, this.head);
      if (ticket !== this.ticket) return; // a later hover has been drawn (or is on its way)
      this.draw(b);
    }

    draw(b) {
      const d = this.data, r = this.row.get(this.step), q0 = r * this.K, lut = this.lut, reach = d.reach[this.step];
      this.keyChips.forEach((c, k) => {
        const read = k < reach, v = read ? b.q[q0 + k] : 0;
        c.classList.toggle("unread", !read);
        c.style.background = read ? "rgb(" + lut[3 * v] + "," + lut[3 * v + 1] + "," + lut[3 * v + 2] + ")" : "";
        c.style.color = read && v > 150 ? "#fff" : "";
      });
      if (this.marked) this.marked.classList.remove("q");
      this.marked = this.outChips[this.step];
      this.marked.classList.add("q");
      const root = this.root;
      root.dataset.layer = String(d.layers[this.li].layer);
      root.dataset.head = this.head < 0 ? "mean" : String(this.head);
      root.dataset.step = String(this.step);
      this.el(".probe-readout").textContent = this.readout(b, r, reach);
    }

    readout(b, r, reach) {
      const d = this.data, q0 = r * this.K, mx = b.max[r], e = d.layers[this.li];
      const who = "Layer " + e.layer + ", " + (this.head < 0 ? "mean over heads" : "head " + this.head);
      const tok = "\u201c" + d.out[this.step] + "\u201d (generated token " + this.step + ")";
      const order = Array.from({ length: reach }, (_, k) => k).sort((a, c) => b.q[q0 + c] - b.q[q0 + a] || a - c);
      const top = order.slice(0, Math.min(TOP, reach)).map((k) => "\u201c" + d.keys[k] + "\u201d " + (b.q[q0 + k] / 255 * mx).toFixed(4));
      let text = who + ": " + tok + " read " + (d.kind === "cross" ? "of the source: " : "most: ") + top.join(", ") +
        " (each \u00b1" + (mx / 510).toPrecision(2) + ")";
      if (e.ratio) {
        const v = e.ratio[this.head < 0 ? e.ratio.length - 1 : this.head][r];
        text += "\nlookback ratio " + (v === null ? "none (nothing generated before it)" : v.toFixed(4)) +
          (this.head < 0 ? " (mean of the heads' ratios)" : "");
      }
      if (d.unknownAsZero) text += "\nthe cache did not keep every weight: those not kept are drawn as 0";
      return text;
    }

    bind() {
      const keys = (ev, move) => {
        if (ev.key === "[" || ev.key === "]") this.setHead(this.head + (ev.key === "]" ? 1 : -1));
        else if (ev.key === "PageUp" || ev.key === "PageDown") this.setLayer(this.li + (ev.key === "PageDown" ? 1 : -1));
        else if (!move(ev.key)) return;
        ev.preventDefault();
      };
      const pick = (ev) => {
        const t = ev.target.closest(".tok[data-t]");
        if (t && +t.dataset.t !== this.step) this.setStep(+t.dataset.t);
      };
      this.root.querySelectorAll(".probe-gen-keys, .probe-gen-out").forEach((box) => {
        box.addEventListener("mouseover", pick);
        box.addEventListener("focusin", pick);
        box.addEventListener("click", pick);
        box.addEventListener("keydown", (ev) => keys(ev, (key) => {
          if (key !== "ArrowLeft" && key !== "ArrowRight") return false;
          const i = this.data.mapped.indexOf(this.step) + (key === "ArrowRight" ? 1 : -1);
          if (i >= 0 && i < this.Q) this.outChips[this.data.mapped[i]].focus();
          return true;
        }));
      });
    }
  }

  function start() {
    const box = document.querySelector(".probe-gen");
    const probe = (window.probe = window.probe || {});
    probe.genViews = [];
    if (!box) return;
    const hex = box.dataset.lut, lut = new Uint8Array(hex.length / 2);
    for (let i = 0; i < lut.length; i++) lut[i] = parseInt(hex.substr(2 * i, 2), 16);
    box.querySelectorAll(".probe-genview").forEach((root) => probe.genViews.push(new GenView(root, lut)));
    probe.genReady = Promise.all(probe.genViews.map((v) => v.ready)).then(() => {
      document.documentElement.dataset.probeGenReady = "1";
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
