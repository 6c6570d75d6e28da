/* probe report, "What the generated text read": hover (tap, or Tab to) a generated token to shade
 * every token it read by its weight: the prompt and the output before it (the generating stack),
 * or the source (an encoder-decoder's cross-attention). The rows come from the view's JSON block
 * (quantised per row, deflated, base64: see probe/report/sections/_generation_views.py), inflated
 * with report.js's probe.inflate; every model string reaches the page through textContent. The
 * layer and head selection, the blocks and the keys are layer_views.js's, which runs first. */
(function () {
  "use strict";
  const TOP = 5; // keys the readout names

  class GenView extends window.probeViews.LayerHeadView {
    constructor(root, lut) {
      super(root, lut);
      const d = this.data;
      this.K = this.width = d.keys.length;
      this.Q = d.mapped.length;
      this.row = new Map(d.mapped.map((t, i) => [t, i])); // generated token -> row of the blocks
      this.chips(); // the key chips and the generated tokens' chips
      this.step = d.mapped[d.mapped.length - 1];
      this.selectors();
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

    setStep(t) {
      if (!this.row.has(t)) return Promise.resolve();
      this.step = t;
      return this.show();
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
      const keys = (ev, move) => this.keys(ev, move);
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

  window.probeViews.start(".probe-gen", ".probe-genview", GenView, "genViews", "genReady", "probeGenReady");
})();
