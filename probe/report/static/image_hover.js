/* probe report, "Attention on the picture": hover (tap, or focus and use the arrows on) a patch of
 * the picture to lay that patch's attention map over it; in a vision-language model hover (or
 * focus) a word of the text to lay what it reads of the picture. The maps come from the view's
 * JSON block (quantised per map, deflated, base64: see probe/report/sections/_image_hover.py),
 * inflated with report.js's probe.inflate; every model string reaches the page through
 * textContent. Runs once the page is parsed (report.js, loaded last, is there by then). The layer
 * and head selection, the blocks and the keys are layer_views.js's, which runs first. */
(function () {
  "use strict";
  const TOP = 5; // patches the readout names

  class ImageView extends window.probeViews.LayerHeadView {
    constructor(root, lut) {
      super(root, lut);
      const d = this.data;
      this.P = this.width = d.rows * d.cols;
      this.Q = d.positions.length;
      this.pre = d.nPrefix; // a patch view's queries: the tokens that are not patches ([CLS], ...), then the patches
      this.pic = this.el(".probe-pic");
      this.canvas = this.el(".probe-pic-map");
      // a patch view starts from [CLS] (or the middle patch), a text view from its last word
      this.query = d.kind === "patch" ? (this.pre > 0 ? 0 : this.middle()) : this.Q - 1;
      this.layout();
      this.selectors();
      this.bind();
      this.drawScale();
      this.ready = this.show().then(() => { root.dataset.ready = "1"; });
    }

    middle() { const d = this.data; return this.pre + (d.rows >> 1) * d.cols + (d.cols >> 1); }

    // The picture and its map at the same scale: the longer side about 360 px, the grid's patches
    // at their place in the processed image's pixels.
    layout() {
      const d = this.data, H = d.image[0], W = d.image[1];
      const s = (this.zoom = Math.max(1, Math.min(12, 360 / Math.max(H, W))));
      this.pic.style.width = W * s + "px";
      this.pic.style.height = H * s + "px";
      this.canvas.width = d.cols; this.canvas.height = d.rows;
      this.canvas.style.width = d.cols * d.patch[1] * s + "px";
      this.canvas.style.height = d.rows * d.patch[0] * s + "px";
    }

    setQuery(q) {
      this.query = Math.max(0, Math.min(this.Q - 1, q));
      return this.show();
    }

    draw(b) {
      const d = this.data, P = this.P, q0 = this.query * P, lut = this.lut;
      const img = new ImageData(d.cols, d.rows);
      for (let k = 0; k < P; k++) {
        const c = 3 * b.q[q0 + k];
        img.data[4 * k] = lut[c]; img.data[4 * k + 1] = lut[c + 1]; img.data[4 * k + 2] = lut[c + 2]; img.data[4 * k + 3] = 255;
      }
      this.canvas.getContext("2d").putImageData(img, 0, 0);
      const root = this.root;
      root.dataset.layer = String(d.layers[this.li].layer);
      root.dataset.head = this.head < 0 ? "mean" : String(this.head);
      root.dataset.query = String(this.query);
      this.outline();
      this.markWord();
      this.el(".probe-readout").textContent = this.readout(b);
    }

    patchName(k) { return "patch (" + Math.floor(k / this.data.cols) + ", " + (k % this.data.cols) + ")"; }

    queryName() {
      const d = this.data;
      if (d.kind === "patch" && this.query >= this.pre) return this.patchName(this.query - this.pre);
      if (d.kind === "patch") return d.labels[this.query];
      return "\u201c" + d.labels[this.query] + "\u201d (position " + d.positions[this.query] + ")";
    }

    readout(b) {
      const d = this.data, P = this.P, q0 = this.query * P, mx = b.max[this.query], sum = b.sum[this.query];
      const who = "Layer " + d.layers[this.li].layer + ", " + (this.head < 0 ? "mean over heads" : "head " + this.head);
      const where = d.kind === "patch" ? "the picture's patches" : "this picture";
      if (!(mx > 0)) return who + ": " + this.queryName() + " reads none of " + where + " (weight 0 on every patch)";
      const order = Array.from({ length: P }, (_, k) => k).sort((a, c) => b.q[q0 + c] - b.q[q0 + a] || a - c);
      const top = order.slice(0, Math.min(TOP, P)).map((k) => this.patchName(k) + " " + (b.q[q0 + k] / 255 * mx).toFixed(4));
      return who + ": " + this.queryName() + " reads: " + top.join(", ") + " (top " + top.length + " of " + P +
        ", each \u00b1" + (mx / 510).toPrecision(2) + ")\n" + sum.toFixed(4) + " of its attention lands on " + where +
        "; its largest weight " + mx.toFixed(4) + " is the top of the colour scale";
    }

    // the hovered patch outlined (none when the query is a word or [CLS])
    outline() {
      const d = this.data, s = this.zoom, band = this.el(".band-cell"), k = this.query - this.pre;
      band.hidden = d.kind !== "patch" || k < 0;
      if (band.hidden) return;
      const r = Math.floor(k / d.cols), c = k % d.cols;
      band.style.left = c * d.patch[1] * s - 2 + "px"; band.style.top = r * d.patch[0] * s - 2 + "px";
      band.style.width = d.patch[1] * s + 4 + "px"; band.style.height = d.patch[0] * s + 4 + "px";
    }

    markWord() {
      if (this.marked) this.marked.classList.remove("q");
      this.marked = this.root.querySelector('.probe-words .tok[data-q="' + this.query + '"]');
      if (this.marked) this.marked.classList.add("q");
    }

    // the patch under a pointer event, or -1 outside the grid
    patchAt(ev) {
      const d = this.data, r = this.pic.getBoundingClientRect(), s = this.zoom;
      const row = Math.floor((ev.clientY - r.top) / s / d.patch[0]), col = Math.floor((ev.clientX - r.left) / s / d.patch[1]);
      return row >= 0 && col >= 0 && row < d.rows && col < d.cols ? row * d.cols + col : -1;
    }

    bind() {
      const d = this.data;
      const keys = (ev, move) => this.keys(ev, move);
      if (d.kind === "patch") {
        const at = (ev) => { const k = this.patchAt(ev); if (k >= 0 && this.pre + k !== this.query) this.setQuery(this.pre + k); };
        this.pic.addEventListener("pointermove", at);
        this.pic.addEventListener("pointerdown", at);
        // focused (Tab), the picture shows a patch's map: the middle one if [CLS]'s was shown
        this.pic.addEventListener("focus", () => { if (this.query < this.pre) this.setQuery(this.middle()); });
        this.pic.addEventListener("keydown", (ev) => keys(ev, (key) => {
          const m = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[key];
          if (!m) return false;
          const k = Math.max(0, this.query - this.pre);
          const r = Math.max(0, Math.min(d.rows - 1, Math.floor(k / d.cols) + m[0]));
          const c = Math.max(0, Math.min(d.cols - 1, (k % d.cols) + m[1]));
          this.setQuery(this.pre + r * d.cols + c);
          return true;
        }));
      }
      const words = this.el(".probe-words");
      if (!words) return;
      const pick = (ev) => {
        const t = ev.target.closest(".tok[data-q]");
        if (t && +t.dataset.q !== this.query) this.setQuery(+t.dataset.q);
      };
      words.addEventListener("mouseover", pick);
      words.addEventListener("focusin", pick);
      words.addEventListener("click", pick);
      words.addEventListener("keydown", (ev) => keys(ev, (key) => {
        if (key !== "ArrowLeft" && key !== "ArrowRight") return false;
        const chips = Array.from(words.querySelectorAll(".tok[data-q]"));
        const i = chips.findIndex((t) => +t.dataset.q === this.query) + (key === "ArrowRight" ? 1 : -1);
        if (i >= 0 && i < chips.length) chips[i].focus();
        return true;
      }));
    }

    // the colour bar: 0 on the left, the map's largest weight on the right
    drawScale() {
      const cv = this.el(".probe-colorbar"), ctx = cv.getContext("2d"), lut = this.lut;
      for (let x = 0; x < cv.width; x++) {
        const c = 3 * Math.round((x / (cv.width - 1)) * 255);
        ctx.fillStyle = "rgb(" + lut[c] + "," + lut[c + 1] + "," + lut[c + 2] + ")";
        ctx.fillRect(x, 0, 1, cv.height);
      }
    }
  }

  window.probeViews.start(".probe-images", ".probe-imgview", ImageView, "imageViews", "imagesReady", "probeImagesReady");
})();
