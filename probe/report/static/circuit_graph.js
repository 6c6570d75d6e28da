/* probe report: the circuit section's graph (sections/circuit.py draws it as SVG). Clicking a head,
 * or Enter / Space on a focused one, shows that head in the page's head explorers (the attention
 * section's and, when the cache holds contributions, the weights-and-contributions pair) through
 * their own layer and head selectors, and the line under the graph lists the drawn edges into and
 * out of it. Model strings reach the page through textContent only. */
(function () {
  "use strict";
  const script = document.currentScript;
  const sec = (script && script.closest(".probe-section")) || document.getElementById("sec-circuit");
  if (!sec) return;
  const readout = sec.querySelector(".probe-circuit-readout");
  const EXPLORERS = '.probe-attn[data-view="attention"], .probe-attn[data-view="contrib-w"]';

  // Choose the option whose text is `text` and tell the explorer, as a person choosing it would.
  function choose(sel, text) {
    const opt = sel && Array.from(sel.options).find((o) => o.text === text);
    if (!opt) return false;
    if (sel.value !== opt.value) { sel.value = opt.value; sel.dispatchEvent(new Event("change")); }
    return true;
  }

  function showHead(layer, head) {
    const shown = [];
    document.querySelectorAll(EXPLORERS).forEach((view) => {
      if (choose(view.querySelector(".sel-layer"), String(layer)) && choose(view.querySelector(".sel-head"), String(head))) {
        shown.push(view);
      }
    });
    return shown;
  }

  function edgesOf(name) {
    const into = [], out = [];
    sec.querySelectorAll(".probe-circuit-edge").forEach((p) => {
      const score = Number(p.dataset.score).toPrecision(4);
      if ((p.dataset.readers || "").split(" ").includes(name)) into.push(p.dataset.source + " \u2192 " + p.dataset.target.split(".").pop() + " (" + score + ")");
      if (p.dataset.source === name) out.push("\u2192 " + p.dataset.target + " (" + score + ")");
    });
    return [into, out];
  }

  function pick(node) {
    const name = node.dataset.node, layer = node.dataset.layer, head = node.dataset.head;
    sec.querySelectorAll(".probe-circuit-node.picked").forEach((n) => n.classList.remove("picked"));
    node.classList.add("picked");
    const shown = showHead(layer, head), [into, out] = edgesOf(name);
    readout.textContent = name + ": reads " + (into.length ? into.join(", ") : "nothing drawn") + "; writes " + (out.length ? out.join(", ") : "nothing drawn") + ". ";
    if (shown.length) {
      const go = document.createElement("button");
      go.type = "button";
      go.textContent = "show it in the head explorer";
      go.addEventListener("click", () => shown[0].querySelector(".sel-head").scrollIntoView({ block: "start" }));
      readout.append("Layer " + layer + ", head " + head + " is chosen in the head explorer" + (shown.length > 1 ? "s" : "") + ": ", go);
    } else {
      readout.append("This report has no head explorer holding it (the cache kept no whole patterns of that layer).");
    }
    readout.dataset.node = name;
  }

  sec.querySelectorAll('.probe-circuit-node[data-kind="head"]').forEach((node) => {
    node.addEventListener("click", () => pick(node));
    node.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); pick(node); }
    });
  });
})();
