"""Tests of md4jax.sampling.trajectory on hand-built trajectories with a known reveal order."""

import html.parser
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from md4jax.sampling import trajectory as traj

MASK = 30
S, B, L, K = 4, 2, 8, 3
# Step at which each position of sample 0 is revealed (1..S); sample 1 reverses it.
REVEAL_STEP = np.array([2, 1, 4, 3, 1, 2, 4, 3])
WORDS = "abcdefghijklmnopqrstuvwxyz"


def decode(i):
  return WORDS[i]


def make_trajectory(with_alphas=True):
  """tokens[s] holds the final token at positions revealed by step s, MASK elsewhere."""
  final = np.stack([np.arange(L), np.arange(L) + 10])  # [B, L]
  reveal = np.stack([REVEAL_STEP, REVEAL_STEP[::-1]])  # [B, L]
  steps = np.arange(S + 1)[:, None, None]
  tokens = np.where(reveal[None] <= steps, final[None], MASK).astype(np.int32)
  rng = np.random.default_rng(0)
  top_ids = rng.integers(0, 26, size=(S, B, L, K)).astype(np.int32)
  top_ids[..., 0] = final[None]
  probs = rng.dirichlet(np.ones(K), size=(S, B, L)).astype(np.float32)
  top_probs = -np.sort(-probs, axis=-1)
  t = {"tokens": tokens, "top_ids": top_ids, "top_probs": top_probs}
  if with_alphas:
    t["alphas"] = np.linspace(0.0, 0.75, S).astype(np.float32)
  return t


class _Collector(html.parser.HTMLParser):
  """Records start tags and the text inside <script type="application/json" id="trajectory-data">."""

  def __init__(self):
    super().__init__()
    self.tags, self.json_text, self._in_json = [], [], False
    self.token_spans, self._in_tok = [], False

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    self.tags.append((tag, attrs))
    self._in_json = tag == "script" and attrs.get("id") == "trajectory-data"
    self._in_tok = (
      tag == "span" and "tok" in (attrs.get("class") or "").split() and "data-pos" in attrs
    )
    if self._in_tok:
      self.token_spans.append("")

  def handle_endtag(self, tag):
    self._in_json = self._in_tok = False

  def handle_data(self, data):
    if self._in_json:
      self.json_text.append(data)
    if self._in_tok:
      self.token_spans[-1] += data


def parse(page):
  parser = _Collector()
  parser.feed(page)
  parser.close()
  return parser


@pytest.mark.parametrize("sample_index", [0, 1])
def test_html_structure_and_json_round_trip(sample_index):
  t = make_trajectory()
  page = traj.render_html(t, mask_id=MASK, decode=decode, sample_index=sample_index)
  assert page.startswith("<!DOCTYPE html>")
  assert "http" not in page
  parser = parse(page)
  ranges = [a for tag, a in parser.tags if tag == "input" and a.get("type") == "range"]
  assert len(ranges) == 1 and ranges[0]["max"] == str(S) and ranges[0]["min"] == "0"
  for button in ("prev", "next", "play"):
    assert ("button", {"id": button, "type": "button"}) in parser.tags
  data = json.loads("".join(parser.json_text))
  assert data["steps"] == S and data["length"] == L and data["mask_id"] == MASK
  np.testing.assert_array_equal(data["tokens"], t["tokens"][:, sample_index])
  np.testing.assert_array_equal(data["top_ids"], t["top_ids"][:, sample_index])
  np.testing.assert_allclose(data["top_probs"], t["top_probs"][:, sample_index], atol=1e-6)
  np.testing.assert_allclose(data["alphas"], t["alphas"], atol=1e-6)
  ids = np.union1d(t["tokens"][:, sample_index], t["top_ids"][:, sample_index])
  assert data["vocab"] == {str(i): WORDS[i] for i in ids if i != MASK}
  # No script/style loads from anywhere: everything is inline.
  assert not any(a.get("src") or a.get("href") for _, a in parser.tags)


def test_alphas_optional_and_per_sample():
  t = make_trajectory(with_alphas=False)
  data = json.loads("".join(parse(traj.render_html(t, mask_id=MASK, decode=decode)).json_text))
  assert data["alphas"] is None
  t["alphas"] = np.array(
    [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]]
  )  # [S, B], as the samplers record
  page = traj.render_html(t, mask_id=MASK, decode=decode, sample_index=1)
  np.testing.assert_allclose(
    json.loads("".join(parse(page).json_text))["alphas"], [0.2, 0.4, 0.6, 0.8]
  )


def test_special_characters_are_escaped():
  nasty = ['<script>alert("x")</script>', "a&b", '"q"', "</script><b>", "see https://example.com"]

  def decode_nasty(i):
    return nasty[i % len(nasty)]

  t = make_trajectory()
  title = '<Title & "stuff"> http://x'
  page = traj.render_html(t, mask_id=MASK, decode=decode_nasty, title=title)
  assert "<script>alert" not in page and "</script><b>" not in page and "<b>" not in page
  assert "http" not in page
  assert page.count("</script>") == 2  # The JSON tag and the code tag, nothing injected.
  parser = parse(page)
  data = json.loads("".join(parser.json_text))
  assert data["title"] == title
  assert set(data["vocab"].values()) == set(nasty)  # Escaping is lossless.
  assert "&lt;Title &amp; &quot;stuff&quot;&gt;" in page


@pytest.mark.parametrize(
  "mutate, message",
  [
    (lambda t: t.update(tokens=t["tokens"][0]), "tokens must be 3-D"),
    (lambda t: t.update(tokens=t["tokens"].astype(np.float32)), "tokens must be integers"),
    (lambda t: t.update(top_ids=t["top_ids"][:-1]), "top_ids must have shape"),
    (lambda t: t.update(top_ids=t["top_ids"][:, :, :-1]), "top_ids must have shape"),
    (lambda t: t.update(top_ids=t["top_ids"][..., 0]), "top_ids must have shape"),
    (lambda t: t.update(top_probs=t["top_probs"][..., :-1]), "top_probs shape"),
    (
      lambda t: t.update(top_probs=np.full_like(t["top_probs"], np.nan)),
      "top_probs must be finite",
    ),
    (lambda t: t.update(alphas=np.zeros(S + 1)), "alphas must have shape"),
    (lambda t: t.pop("top_probs"), "missing 'top_probs'"),
  ],
)
def test_validation_errors(mutate, message):
  t = make_trajectory()
  mutate(t)
  with pytest.raises(ValueError, match=message):
    traj.render_html(t, mask_id=MASK, decode=decode)
  with pytest.raises(ValueError, match=message):
    traj.render_gif(t, "/nonexistent/never-written.gif", mask_id=MASK, decode=decode)


@pytest.mark.parametrize("sample_index", [-1, B, 1.0])
def test_sample_index_out_of_range(sample_index):
  with pytest.raises(ValueError, match=r"sample_index must be an integer in \[0, 2\)"):
    traj.render_html(make_trajectory(), mask_id=MASK, decode=decode, sample_index=sample_index)


def test_write_html(tmp_path):
  path = str(tmp_path / "t.html")
  assert traj.write_html(path, make_trajectory(), mask_id=MASK, decode=decode) == path
  with open(path, encoding="utf-8") as f:
    assert f.read() == traj.render_html(make_trajectory(), mask_id=MASK, decode=decode)


def _gif_frames(path):
  from PIL import Image  # pylint: disable=g-import-not-at-top

  with Image.open(path) as im:
    assert im.format == "GIF" and im.is_animated
    frames = []
    for i in range(im.n_frames):
      im.seek(i)
      frames.append(np.asarray(im.convert("RGB")))
    return frames


@pytest.mark.parametrize("max_frames", [60, 3])
def test_gif(tmp_path, max_frames):
  pytest.importorskip("PIL")
  path = str(tmp_path / "t.gif")
  assert (
    traj.render_gif(make_trajectory(), path, mask_id=MASK, decode=decode, max_frames=max_frames)
    == path
  )
  frames = _gif_frames(path)
  assert len(frames) == min(S + 1, max_frames)
  for a, b in zip(frames, frames[1:]):
    assert a.shape == b.shape and not np.array_equal(a, b)
  grey, yellow = np.array(traj._MASK_RGB), np.array(traj._NEW_RGB)
  # The first frame is all masks (grey, nothing new); the last has no mask but new tokens.
  assert (frames[0] == grey).all(-1).any() and not (frames[0] == yellow).all(-1).any()
  assert not (frames[-1] == grey).all(-1).any() and (frames[-1] == yellow).all(-1).any()


def test_gif_subsampling_steps():
  assert traj._frame_steps(4, 60) == [0, 1, 2, 3, 4]
  for num_steps, max_frames in [(4, 2), (4, 3), (100, 7), (1000, 60), (59, 60), (60, 60)]:
    steps = traj._frame_steps(num_steps, max_frames)
    assert steps[0] == 0 and steps[-1] == num_steps
    assert len(steps) == min(num_steps + 1, max_frames)
  with pytest.raises(ValueError, match="max_frames must be >= 2"):
    traj.render_gif(
      make_trajectory(), "/nonexistent/x.gif", mask_id=MASK, decode=decode, max_frames=1
    )


def test_chromium_renders_last_step(tmp_path):
  browser = shutil.which("chromium") or shutil.which("chromium-browser")
  if browser is None:
    pytest.skip("chromium not installed")
  t = make_trajectory()
  path = traj.write_html(str(tmp_path / "t.html"), t, mask_id=MASK, decode=decode)
  cmd = [
    browser,
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    f"--user-data-dir={tmp_path / 'profile'}",
    "--dump-dom",
    "file://" + os.path.abspath(path),
  ]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  dom = parse(result.stdout)
  # The spans exist only if the script ran; the last step is fully revealed.
  assert dom.token_spans == [decode(i) for i in t["tokens"][S, 0]]
  assert f"step {S} / {S}" in result.stdout and f"masks remaining: 0 / {L}" in result.stdout
  assert "\u03b1 = 0.7500" in result.stdout
