// Placement board: clicking a unit shows who holds it (device, VM, tenant, reason) with
// links to the device and to its set's decision log. Without JavaScript the cell is a
// plain link to the device page, and hovering shows the same text as a tooltip.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var board = document.getElementById("gp-board");
  var panel = document.getElementById("cell-info");
  if (!board || !panel) { return; }
  var decisionsUrl = board.getAttribute("data-decisions-url");
  board.addEventListener("click", function (event) {
    var cell = event.target.closest("a.u");
    if (!cell || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) { return; }
    event.preventDefault();
    panel.querySelector(".what").textContent = cell.getAttribute("title");
    var open = panel.querySelector(".open");
    open.setAttribute("href", cell.getAttribute("href"));
    open.textContent = cell.classList.contains("p") ? "pods of this name" : "device page";
    var log = panel.querySelector(".log");
    var set = cell.getAttribute("data-set");
    if (set) {
      var parts = set.split("/");
      log.setAttribute("href", decisionsUrl + "?" + new URLSearchParams({namespace: parts[0], vm: parts[1]}).toString());
      log.hidden = false;
    } else {
      log.hidden = true;
    }
    panel.hidden = false;
  });
  panel.querySelector(".close").addEventListener("click", function () { panel.hidden = true; });
});
