/* probe report: what the hover views share (the generated text's and the picture's). A view reads
 * its JSON block (layers, each with a head-mean block and perhaps every head's, quantised per row,
 * deflated, base64), shows one layer and head at a time (the selectors, "[" "]" for the head,
 * PageUp/PageDown for the layer) and draws the block of the row it is asked for; a subclass says
 * how wide its rows are and draws them. Defined once per page: each view's script starts with it. */
(function () {
  "use strict";
  if (window.probeViews) return;

  class LayerHeadView {
    constructor(root, lut) {
      this.root = root;
      this.lut = lut;
      this.data = JSON.parse(root.querySelector("script.probe-data").textContent);
      this.el = (sel) => root.querySelector(sel);
      this.blocks = new Map();
      this.li = this.data.layers.length - 1;
      this.head = -1; // -1: the mean over heads
    }

    // the layer and head selectors, filled and listened to (after the subclass has set its rows)
    selectors() {
      const selL = this.el(".sel-layer");
      this.data.layers.forEach((e, i) => selL.add(new Option(String(e.layer), String(i))));
      selL.value = String(this.li);
      selL.addEventListener("change", () => this.setLayer(+selL.value));
      this.el(".sel-head").addEventListener("change", (ev) => { this.head = +ev.target.value; this.show(); });
      this.fillHeads();
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

    // One layer's rows (the mean, or head h): {max, sum: Float32Array [Q], q: Uint8Array [Q * width]}.
    block(li, h) {
      const key = li + ":" + h;
      if (!this.blocks.has(key)) {
        const e = this.data.layers[li], Q = this.Q, W = this.width;
        this.blocks.set(key, window.probe.inflate(h < 0 ? e.mean : e.heads[h]).then((raw) => ({
          max: new Float32Array(raw.buffer, raw.byteOffset, Q),
          sum: new Float32Array(raw.buffer, raw.byteOffset + 4 * Q, Q),
          q: raw.subarray(8 * Q, 8 * Q + Q * W),
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

    // the keys every view takes ("[" "]" head, PageUp/PageDown layer), else ``move(key)``'s own
    keys(ev, move) {
      if (ev.key === "[" || ev.key === "]") this.setHead(this.head + (ev.key === "]" ? 1 : -1));
      else if (ev.key === "PageUp" || ev.key === "PageDown") this.setLayer(this.li + (ev.key === "PageDown" ? 1 : -1));
      else if (!move(ev.key)) return;
      ev.preventDefault();
    }
  }

  // Build every ``view`` element inside the first ``box`` element as a ``Cls`` (the box holds the
  // colour table as hex in data-lut); ``probe[list]`` holds them, ``probe[ready]`` resolves and
  // the page's root gets ``data-<flag>="1"`` once all are drawn.
  function start(box, view, Cls, list, ready, flag) {
    const run = () => {
      const el = document.querySelector(box);
      const probe = (window.probe = window.probe || {});
      probe[list] = [];
      if (!el) return;
      const hex = el.dataset.lut, lut = new Uint8Array(hex.length / 2);
      for (let i = 0; i < lut.length; i++) lut[i] = parseInt(hex.substr(2 * i, 2), 16);
      el.querySelectorAll(view).forEach((root) => probe[list].push(new Cls(root, lut)));
      probe[ready] = Promise.all(probe[list].map((v) => v.ready)).then(() => {
        document.documentElement.dataset[flag] = "1";
      });
    };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", run);
    else run();
  }

  window.probeViews = { LayerHeadView, start };
})();
