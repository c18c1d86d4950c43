// Placement board. Hovering a unit lights up its whole set; clicking it (or Enter on it)
// pins the set and opens a panel beside the cell: who holds it (device, VM, tenant, reason)
// with links to the device, its set's decision log and a deep link (?q=namespace/VM).
// Escape closes the panel and gives focus back to the cell. Keyboard: one Tab stop for the
// whole board (a roving tabindex); the arrow keys move between held units, Home/End to a
// row's first/last. Without JavaScript every cell is a plain link to its device page, and
// hovering shows the same text as a tooltip.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var board = document.getElementById("gp-board");
  var panel = document.getElementById("cell-info");
  if (!board || !panel) { return; }
  var decisionsUrl = board.getAttribute("data-decisions-url");
  var page = document.querySelector(".gp-board-page") || document.body;
  var lastCell = null;

  // -- the whole set lit up --------------------------------------------------------------
  function setCells(key, root) {
    if (!key) { return []; }
    var escaped = window.CSS && CSS.escape ? CSS.escape(key) : key.replace(/["\\]/g, "\\$&");
    return (root || page).querySelectorAll('[data-set="' + escaped + '"]');
  }
  function light(key, css, on) {
    page.querySelectorAll("." + css).forEach(function (el) { if (!on || el.getAttribute("data-set") !== key) { el.classList.remove(css); } });
    if (on) { setCells(key).forEach(function (el) { el.classList.add(css); }); }
  }
  page.addEventListener("mouseover", function (event) {
    var cell = event.target.closest(".u[data-set]");
    light(cell ? cell.getAttribute("data-set") : "", "hl", !!cell);
  });
  page.addEventListener("mouseleave", function () { light("", "hl", false); });

  // -- the panel, beside the cell -------------------------------------------------------
  function place(cell) {
    panel.style.left = ""; panel.style.top = "";
    if (window.innerWidth < 600) { panel.classList.add("sheet"); return; }  // a phone: a sheet at the bottom
    panel.classList.remove("sheet");
    // Beside the node's units (not over the set): right of the strip, else below the cell.
    var rect = cell.getBoundingClientRect();
    var strip = (cell.closest(".strip") || cell.closest("td") || cell).getBoundingClientRect();
    var width = panel.offsetWidth, height = panel.offsetHeight;
    var left = strip.right + 12, top = rect.top - 8;
    if (left + width > window.innerWidth - 8) {
      left = Math.min(Math.max(8, rect.left), window.innerWidth - width - 8);
      top = rect.bottom + 8;
    }
    top = Math.min(Math.max(8, top), Math.max(8, window.innerHeight - height - 8));
    panel.style.left = (left + window.scrollX) + "px";
    panel.style.top = (top + window.scrollY) + "px";
  }
  function open(cell, fromKeyboard) {
    var key = cell.getAttribute("data-set") || "";
    var pod = cell.classList.contains("p");
    panel.querySelector("#cell-info-heading").textContent = key ? "set " + key : "pod's raw usage";
    panel.querySelector(".what").textContent = cell.getAttribute("title") || "";
    var lostRow = key ? document.querySelector('#gp-lost tr[data-set="' + (window.CSS && CSS.escape ? CSS.escape(key) : key) + '"] .explain') : null;
    panel.querySelector(".why").textContent = lostRow ? lostRow.textContent : "";
    var openLink = panel.querySelector(".open");
    openLink.hidden = !cell.getAttribute("href");
    openLink.setAttribute("href", cell.getAttribute("href") || "#");
    openLink.textContent = pod ? "pods of this name" : "device page";
    var log = panel.querySelector(".log"), deep = panel.querySelector(".deep");
    if (key) {
      var parts = key.split("/");
      log.setAttribute("href", decisionsUrl + "?" + new URLSearchParams({namespace: parts[0], vm: parts[1]}).toString());
      var params = new URLSearchParams(window.location.search);
      params.set("q", key); params.delete("page");
      deep.setAttribute("href", "?" + params.toString());
      history.replaceState(null, "", "?" + params.toString());
    }
    log.hidden = deep.hidden = !key;
    light(key, "pin", !!key);
    panel.hidden = false;
    place(cell);
    lastCell = cell;
    if (fromKeyboard) { panel.querySelector(".close").focus(); }
  }
  function close() {
    if (panel.hidden) { return; }
    panel.hidden = true;
    light("", "pin", false);
    if (lastCell) { lastCell.focus(); }
  }
  page.addEventListener("click", function (event) {
    var cell = event.target.closest("#gp-board a.u, #gp-lost .u[data-set]");
    if (!cell || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) { return; }
    event.preventDefault();
    open(cell, event.detail === 0);  // detail 0: Enter on a link, not a mouse click
  });
  panel.querySelector(".close").addEventListener("click", close);
  document.addEventListener("keydown", function (event) { if (event.key === "Escape") { close(); } });

  // -- keyboard: one Tab stop, arrows between cells --------------------------------------
  var rows = Array.prototype.slice.call(board.querySelectorAll("tbody tr.node"));
  function cellsOf(row) { return Array.prototype.slice.call(row.querySelectorAll("a.u")); }
  var first = null;
  rows.forEach(function (row) {
    cellsOf(row).forEach(function (cell) {
      cell.setAttribute("tabindex", first ? "-1" : "0");
      if (!first) { first = cell; }
    });
  });
  function moveTo(cell) {
    if (!cell) { return; }
    board.querySelectorAll('a.u[tabindex="0"]').forEach(function (el) { el.setAttribute("tabindex", "-1"); });
    cell.setAttribute("tabindex", "0");
    cell.focus();
    light(cell.getAttribute("data-set"), "hl", true);
  }
  function nearest(row, x) {
    var best = null, distance = Infinity;
    cellsOf(row).forEach(function (cell) {
      var rect = cell.getBoundingClientRect(), d = Math.abs(rect.left + rect.width / 2 - x);
      if (d < distance) { best = cell; distance = d; }
    });
    return best;
  }
  board.addEventListener("keydown", function (event) {
    var cell = event.target.closest("a.u");
    if (!cell) { return; }
    var row = cell.closest("tr"), cells = cellsOf(row), at = cells.indexOf(cell), index = rows.indexOf(row);
    var x = cell.getBoundingClientRect().left + cell.getBoundingClientRect().width / 2, next = null, step;
    if (event.key === "ArrowRight") { next = cells[at + 1]; }
    else if (event.key === "ArrowLeft") { next = cells[at - 1]; }
    else if (event.key === "Home") { next = cells[0]; }
    else if (event.key === "End") { next = cells[cells.length - 1]; }
    else if (event.key === "ArrowDown" || event.key === "ArrowUp") {
      step = event.key === "ArrowDown" ? 1 : -1;
      for (var i = index + step; i >= 0 && i < rows.length && !next; i += step) { next = nearest(rows[i], x); }
    } else { return; }
    event.preventDefault();
    moveTo(next);
  });
  var skip = document.getElementById("skip-to-cells");
  if (skip) {
    skip.addEventListener("click", function (event) {
      var target = board.querySelector('a.u[tabindex="0"]');
      if (target) { event.preventDefault(); target.focus(); }
    });
  }

  // -- ?q=: the set highlighted, its page shown, its panel open ---------------------------
  if (board.getAttribute("data-q")) {
    var pinned = page.querySelector("#gp-board .u.pin, #gp-lost .u.pin");
    if (pinned) {
      pinned.scrollIntoView({block: "center"});
      if (pinned.tagName === "A") { moveTo(pinned); }
      open(pinned, false);
    }
  }
});
