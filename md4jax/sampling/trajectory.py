"""Pictures of a sampling trajectory: a self-contained HTML viewer and an animated GIF.

A trajectory is the dict the samplers in `md4jax.sampling.samplers` record (NumPy or JAX arrays):
  tokens    int   [S + 1, B, L]  state before step 1 (index 0) and after each step
  top_ids   int   [S, B, L, K]   the denoiser's K most likely clean tokens at each step
  top_probs float [S, B, L, K]   their probabilities
  alphas    float [S] or [S, B]  α(t) fed to the network at each step (optional)
Display step s ∈ [0, S] shows tokens[s]; its candidates are those of sampler step s
(top_ids[s - 1]), i.e. the predictions that produced tokens[s]. Step 0 has none.
"""

import html
import json
import math

import numpy as np

# GIF colours; the mask grey is slightly blue so it never equals an anti-aliased text pixel.
_MASK_RGB = (205, 205, 215)
_NEW_RGB = (255, 224, 102)


def _validate(trajectory, sample_index):
  """Checks shapes and returns (tokens [S+1, L], top_ids, top_probs [S, L, K], alphas [S] | None)."""
  if not isinstance(trajectory, dict):
    raise ValueError(f"trajectory must be a dict of arrays, got {type(trajectory).__name__}")
  for key in ("tokens", "top_ids", "top_probs"):
    if key not in trajectory:
      raise ValueError(f"trajectory is missing {key!r} (has {sorted(trajectory)})")
  tokens = np.asarray(trajectory["tokens"])
  top_ids = np.asarray(trajectory["top_ids"])
  top_probs = np.asarray(trajectory["top_probs"])
  if tokens.ndim != 3:
    raise ValueError(f"tokens must be 3-D [S + 1, B, L], got shape {tokens.shape}")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  if tokens.shape[0] < 1:
    raise ValueError("tokens must hold at least the initial state (S + 1 >= 1)")
  num_steps, batch, length = tokens.shape[0] - 1, tokens.shape[1], tokens.shape[2]
  if top_ids.ndim != 4 or top_ids.shape[:3] != (num_steps, batch, length):
    raise ValueError(
      f"top_ids must have shape [S, B, L, K] = [{num_steps}, {batch}, {length}, K] "
      f"to match tokens {tokens.shape}, got {top_ids.shape}"
    )
  if not np.issubdtype(top_ids.dtype, np.integer):
    raise ValueError(f"top_ids must be integers, got dtype {top_ids.dtype}")
  if top_probs.shape != top_ids.shape:
    raise ValueError(f"top_probs shape {top_probs.shape} must equal top_ids shape {top_ids.shape}")
  if not np.all(np.isfinite(top_probs)):
    raise ValueError("top_probs must be finite (NaN/inf found)")
  alphas = trajectory.get("alphas")
  if alphas is not None:
    alphas = np.asarray(alphas, np.float64)
    if alphas.shape not in ((num_steps,), (num_steps, batch)):
      raise ValueError(
        f"alphas must have shape [S] = [{num_steps}] or [S, B] = [{num_steps}, {batch}], "
        f"got {alphas.shape}"
      )
    if not np.all(np.isfinite(alphas)):
      raise ValueError("alphas must be finite (NaN/inf found)")
  if not (isinstance(sample_index, (int, np.integer)) and 0 <= sample_index < batch):
    raise ValueError(f"sample_index must be an integer in [0, {batch}), got {sample_index!r}")
  if alphas is not None and alphas.ndim == 2:
    alphas = alphas[:, sample_index]
  return (tokens[:, sample_index], top_ids[:, sample_index], top_probs[:, sample_index], alphas)


def _changed(tokens, prev, mask_id):
  """Positions holding a token now that differs from `prev` (a reveal, or a remasking sampler's edit)."""
  return (tokens != mask_id) & (tokens != prev)


def _data(trajectory, mask_id, decode, sample_index, title):
  """The JSON-ready view of one sample; token text is decoded once per distinct id."""
  tokens, top_ids, top_probs, alphas = _validate(trajectory, sample_index)
  ids = np.unique(np.concatenate([tokens.ravel(), top_ids.ravel()]))
  vocab = {str(int(i)): str(decode(int(i))) for i in ids if int(i) != mask_id}
  return {
    "title": title,
    "mask_id": int(mask_id),
    "steps": int(tokens.shape[0] - 1),
    "length": int(tokens.shape[1]),
    "tokens": tokens.astype(np.int64).tolist(),
    "top_ids": top_ids.astype(np.int64).tolist(),
    # 6 decimals keep the page small; a tooltip shows 3 at most.
    "top_probs": np.round(top_probs.astype(np.float64), 6).tolist(),
    "alphas": None if alphas is None else [float(a) for a in alphas],
    "vocab": vocab,
  }


def _script_json(obj):
  """JSON safe inside <script>: no '<', '>', '&' (so no '</script>'), and no 'http' anywhere."""
  text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
  for raw, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("http", "\\u0068ttp")):
    text = text.replace(raw, esc)
  return text


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
#controls { display: flex; gap: .5em; align-items: center; margin: .5em 0; }
#step { flex: 1; max-width: 40em; }
#info { font-family: monospace; margin: .5em 0; white-space: pre; }
#seq { display: flex; flex-wrap: wrap; gap: 3px; font-family: monospace; }
.tok { padding: 2px 4px; border: 1px solid #ccc; border-radius: 3px; white-space: pre; }
.tok.mask { background: #d0d0d0; color: #666; border-color: #bbb; }
.tok.new { background: #ffe066; border-color: #e0b000; }
#tip { position: absolute; display: none; background: #fff; border: 1px solid #888;
       box-shadow: 2px 2px 6px rgba(0,0,0,.2); padding: 4px 8px; font-family: monospace;
       white-space: pre; pointer-events: none; }
.legend span { margin-right: 1em; }
"""

# Token text is only ever assigned through textContent, so decoded strings cannot inject markup.
_JS = """
(function () {
  var D = JSON.parse(document.getElementById("trajectory-data").textContent);
  var slider = document.getElementById("step"), seq = document.getElementById("seq");
  var info = document.getElementById("info"), tip = document.getElementById("tip");
  var play = document.getElementById("play"), current = D.steps, timer = null;
  function vis(t) {
    if (t === "") return "\\u2205";
    return t.replace(/ /g, "\\u2423").replace(/\\n/g, "\\u21b5").replace(/\\t/g, "\\u21e5");
  }
  function text(id) { return id === D.mask_id ? "[MASK]" : vis(D.vocab[String(id)]); }
  function show(s) {
    current = s = Math.max(0, Math.min(D.steps, s));
    slider.value = s;
    var cur = D.tokens[s], prev = s > 0 ? D.tokens[s - 1] : cur, masks = 0;
    var frag = document.createDocumentFragment();
    for (var i = 0; i < cur.length; i++) {
      var el = document.createElement("span");
      el.className = "tok";
      if (cur[i] === D.mask_id) { el.className += " mask"; masks++; }
      else if (cur[i] !== prev[i]) { el.className += " new"; }
      el.textContent = text(cur[i]);
      el.setAttribute("data-pos", i);
      frag.appendChild(el);
    }
    seq.textContent = "";
    seq.appendChild(frag);
    var alpha = (s > 0 && D.alphas) ? D.alphas[s - 1].toFixed(4) : "-";
    info.textContent = "step " + s + " / " + D.steps + "    \\u03b1 = " + alpha +
        "    masks remaining: " + masks + " / " + D.length;
  }
  function stop() { if (timer) { clearInterval(timer); timer = null; play.textContent = "play"; } }
  slider.addEventListener("input", function () { stop(); show(parseInt(slider.value, 10)); });
  document.getElementById("prev").addEventListener("click", function () { stop(); show(current - 1); });
  document.getElementById("next").addEventListener("click", function () { stop(); show(current + 1); });
  play.addEventListener("click", function () {
    if (timer) { stop(); return; }
    if (current >= D.steps) show(0);
    play.textContent = "pause";
    timer = setInterval(function () {
      if (current >= D.steps) stop(); else show(current + 1);
    }, 400);
  });
  seq.addEventListener("mouseover", function (e) {
    var pos = e.target.getAttribute && e.target.getAttribute("data-pos");
    if (pos === null || pos === undefined) return;
    var p = parseInt(pos, 10), lines = ["position " + p + ", step " + current];
    if (current === 0) lines.push("(no prediction before step 1)");
    else {
      var ids = D.top_ids[current - 1][p], probs = D.top_probs[current - 1][p];
      for (var k = 0; k < ids.length; k++) lines.push(probs[k].toFixed(3) + "  " + text(ids[k]));
    }
    tip.textContent = lines.join("\\n");
    tip.style.display = "block";
  });
  seq.addEventListener("mousemove", function (e) {
    tip.style.left = (e.pageX + 12) + "px"; tip.style.top = (e.pageY + 12) + "px";
  });
  seq.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  show(D.steps);  // The final sample first; the slider walks back through the reverse process.
})();
"""


def render_html(trajectory, *, mask_id, decode, sample_index=0, title="md4jax sampling trajectory"):
  """A self-contained HTML page (inline CSS/JS, no network) stepping through one sample's trajectory."""
  data = _data(trajectory, mask_id, decode, sample_index, title)
  # Title text is escaped like token text; 'http' is broken up so the page never names a URL.
  safe_title = html.escape(title).replace("http", "&#104;ttp")
  return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{safe_title}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{safe_title}</h1>
<div id="controls">
<button id="prev" type="button">prev</button>
<button id="play" type="button">play</button>
<button id="next" type="button">next</button>
<input type="range" id="step" min="0" max="{data["steps"]}" step="1" value="{data["steps"]}">
</div>
<div id="info"></div>
<div class="legend"><span class="tok mask">[MASK]</span><span class="tok new">revealed at this step</span><span class="tok">revealed earlier</span></div>
<p>Hover a position for the denoiser's top candidates at this step.</p>
<div id="seq"></div>
<div id="tip"></div>
<script type="application/json" id="trajectory-data">{_script_json(data)}</script>
<script>{_JS}</script>
</body>
</html>
"""


def write_html(path, trajectory, **kwargs):
  """Writes `render_html(trajectory, **kwargs)` to `path` as UTF-8 and returns `path`."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(render_html(trajectory, **kwargs))
  return path


def _frame_steps(num_steps, max_frames):
  """At most max_frames steps, evenly spread over [0, S], always including 0 and S."""
  if num_steps + 1 <= max_frames:
    return list(range(num_steps + 1))
  # floor(x + .5) rather than round(): half-to-even could map two neighbours to one step.
  picks = np.floor(np.linspace(0, num_steps, max_frames) + 0.5).astype(int)
  return sorted(set(picks.tolist()))


def _cell_text(text, max_chars):
  """Whitespace made visible with characters the default font has, truncated to fit a cell."""
  text = text.replace(" ", "\u00b7").replace("\n", "\\n").replace("\t", "\\t") or "''"
  return text if len(text) <= max_chars else text[: max_chars - 1] + "~"


def render_gif(trajectory, path, *, mask_id, decode, sample_index=0, frame_ms=300, max_frames=60):
  """Writes an animated GIF of one sample's reverse process and returns `path`.

  Each frame shows the sequence in a grid: masks grey, tokens that changed since the
  previous frame yellow (with subsampled steps, nothing revealed in between is missed).
  """
  if max_frames < 2:
    raise ValueError(f"max_frames must be >= 2 (first and last step), got {max_frames}")
  if frame_ms <= 0:
    raise ValueError(f"frame_ms must be positive, got {frame_ms}")
  tokens, _, _, alphas = _validate(trajectory, sample_index)
  # Only GIFs need Pillow, so it is imported here, after the inputs are known to be good.
  from PIL import Image, ImageDraw, ImageFont  # pylint: disable=g-import-not-at-top

  num_steps, length = tokens.shape[0] - 1, tokens.shape[1]
  steps = _frame_steps(num_steps, max_frames)
  try:  # Pillow >= 10.1 with FreeType scales its default font; the 10 px default is hard to read.
    font = ImageFont.load_default(size=14)
  except TypeError:
    font = ImageFont.load_default()
  texts = {
    int(i): _cell_text(str(decode(int(i))), 12) for i in np.unique(tokens) if int(i) != mask_id
  }
  if not isinstance(
    font, ImageFont.FreeTypeFont
  ):  # Pillow without FreeType: a Latin-1 bitmap font.
    texts = {i: t.encode("latin-1", "replace").decode("latin-1") for i, t in texts.items()}
  probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
  _, top, _, bottom = probe.textbbox((0, 0), "Mg[", font=font)
  line_h = bottom - top
  widest = max([probe.textlength(t, font=font) for t in texts.values()] + [line_h])
  cell_w, cell_h, gap, margin = int(math.ceil(widest)) + 6, line_h + 6, 2, 8
  cols = max(1, min(length, (720 - 2 * margin) // (cell_w + gap)))
  rows = -(-length // cols)
  header_h = line_h + 10
  width = max(2 * margin + cols * (cell_w + gap), 260)
  height = 2 * margin + header_h + rows * (cell_h + gap)

  frames, prev_step = [], 0
  for step in steps:
    row = tokens[step]
    new = _changed(row, tokens[prev_step], mask_id)
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    alpha = f"{alphas[step - 1]:.3f}" if alphas is not None and step > 0 else "-"
    masks = int((row == mask_id).sum())
    draw.text(
      (margin, margin),
      f"step {step}/{num_steps}   alpha = {alpha}   masks {masks}/{length}",
      font=font,
      fill="black",
    )
    for pos in range(length):
      x = margin + (pos % cols) * (cell_w + gap)
      y = margin + header_h + (pos // cols) * (cell_h + gap)
      box = (x, y, x + cell_w - 1, y + cell_h - 1)
      if row[pos] == mask_id:
        draw.rectangle(box, fill=_MASK_RGB)
        continue
      draw.rectangle(box, fill=_NEW_RGB if new[pos] else "white", outline=(190, 190, 190))
      draw.text((x + 3, y + 3 - top), texts[int(row[pos])], font=font, fill="black")
    frames.append(img)
    prev_step = step

  # Fast octree, not Pillow's default median cut: quicker to save, and the cells' flat colours
  # stay exact (the timing is in docs/performance.md).
  frames = [
    frame.quantize(method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE) for frame in frames
  ]
  # The last frame lingers so the finished sample is readable before the loop restarts.
  durations = [frame_ms] * (len(frames) - 1) + [frame_ms * 4]
  frames[0].save(
    path,
    format="GIF",
    save_all=True,
    append_images=frames[1:],
    duration=durations,
    loop=0,
    disposal=1,
  )
  return path
