// The audio section's hover views: hover (or focus) a word of the transcript to draw its
// cross-attention over time on the canvas, its timestamps (white; Whisper's raw ones dotted grey
// when refined) and gold span (green) marked.
(function () {
  "use strict";
  const probe = (window.probe = window.probe || {});
  probe.audioViews = [];

  function draw(view, k) {
    const d = view.data, w = d.words[k], c = view.canvas, g = c.getContext("2d");
    const W = c.width, H = c.height, n = d.frames, end = n * d.hop;
    const x = (t) => (t / end) * W;
    g.fillStyle = "#111"; g.fillRect(0, 0, W, H);
    if (w.gs !== undefined) {
      g.fillStyle = "rgba(57, 211, 83, 0.25)"; g.fillRect(x(w.gs), 0, x(w.ge) - x(w.gs), H);
    }
    g.fillStyle = "#f8a23a";
    const bw = W / n;
    for (let i = 0; i < n; i++) {
      const h = (w.q[i] / 255) * (H - 14);
      g.fillRect(i * bw, H - h, Math.max(1, bw - 0.5), h);
    }
    if (w.rs !== undefined) {
      g.strokeStyle = "rgba(200, 200, 200, 0.6)"; g.lineWidth = 1; g.setLineDash([2, 3]);
      g.strokeRect(x(w.rs), 4, x(w.re) - x(w.rs), H - 8);
      g.setLineDash([]);
    }
    g.strokeStyle = "#fff"; g.lineWidth = 2;
    g.strokeRect(x(w.s), 1, x(w.e) - x(w.s), H - 2);
    view.chips.forEach((chip, j) => chip.classList.toggle("here", j === k));
    let peak = 0;
    w.q.forEach((v, i) => { if (v > w.q[peak]) peak = i; });
    let text = `${w.w}: ${w.s.toFixed(2)}-${w.e.toFixed(2)} s`;
    if (w.rs !== undefined) text += ` (raw ${w.rs.toFixed(2)}-${w.re.toFixed(2)} s)`;
    if (w.gs !== undefined) text += ` (gold ${w.gs.toFixed(2)}-${w.ge.toFixed(2)} s)`;
    text += `; attention peaks at ${(peak * d.hop).toFixed(2)}-${((peak + 1) * d.hop).toFixed(2)} s (${w.max.toFixed(4)})`;
    view.readout.textContent = text;
    view.root.dataset.word = String(k);
  }

  document.querySelectorAll(".probe-audioview").forEach((root) => {
    const data = JSON.parse(root.querySelector(".probe-data").textContent);
    const view = {
      root, data,
      canvas: root.querySelector(".probe-audio-canvas"),
      readout: root.querySelector(".probe-readout"),
      chips: Array.from(root.querySelectorAll(".tok[data-w]")),
    };
    probe.audioViews.push(view);
    view.chips.forEach((chip, k) => {
      chip.addEventListener("mouseenter", () => draw(view, k));
      chip.addEventListener("focus", () => draw(view, k));
      chip.addEventListener("click", () => draw(view, k));
      chip.addEventListener("keydown", (e) => {
        const step = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
        if (!step) return;
        e.preventDefault();
        const next = view.chips[(k + step + view.chips.length) % view.chips.length];
        next.focus();
      });
    });
    if (data.words.length) draw(view, 0);
  });
  document.documentElement.dataset.probeAudioReady = "1";
})();
