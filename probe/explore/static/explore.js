// probe serve: a select changes the URL (the page's state), hovering a query shows its own keys,
// and "where it reads" asks the server to capture a text again. No other host is ever contacted.
"use strict";

function shadeClass(w) { return w > 0 ? "a" + Math.min(10, Math.ceil(w * 10)) : ""; }

function clearMarks(box) {
  box.querySelectorAll(".tok").forEach(function (t) {
    t.className = t.className.split(" ").filter(function (c) { return !/^a\d+$/.test(c) && c !== "tgt" && c !== "focus"; }).join(" ");
  });
}

function mark(box, data, only) {
  // every position's keys at their largest weight, or (only) one position's own keys
  clearMarks(box);
  var best = {};
  var targets = {};
  Object.keys(data).forEach(function (q) {
    if (only !== undefined && q !== only) { return; }
    var d = data[q];
    d.k.forEach(function (k, n) { best[k] = Math.max(best[k] || 0, d.w[n]); });
    d.t.forEach(function (k) { targets[k] = true; });
  });
  box.querySelectorAll(".tok").forEach(function (t) {
    var i = t.dataset.i;
    if (data[i]) { t.classList.add("q"); }
    if (best[i]) { var c = shadeClass(best[i]); if (c) { t.classList.add(c); } }
    if (targets[i]) { t.classList.add("tgt"); }
    if (only !== undefined && i === only) { t.classList.add("focus"); }
  });
}

function bind(box) {
  var data = JSON.parse(box.dataset.ex || "{}");
  box.querySelectorAll(".tok.q").forEach(function (t) {
    t.addEventListener("mouseenter", function () { mark(box, data, t.dataset.i); });
    t.addEventListener("mouseleave", function () { mark(box, data); });
  });
}

document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("select[data-autosubmit]").forEach(function (s) {
    s.addEventListener("change", function () { s.form.submit(); });
  });
  document.querySelectorAll(".example[data-ex]").forEach(bind);
  document.querySelectorAll("button.capture").forEach(function (b) {
    b.addEventListener("click", function () {
      var box = b.closest(".example");
      b.disabled = true;
      b.textContent = "capturing…";
      fetch(b.dataset.url).then(function (r) { return r.json(); }).then(function (data) {
        if (data.error) { b.textContent = data.error; return; }
        box.dataset.ex = JSON.stringify(data);
        mark(box, data);
        bind(box);
        b.remove();
      }).catch(function (e) { b.textContent = "failed: " + e; });
    });
  });
});
