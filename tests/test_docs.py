"""The documentation: the configuration reference is current, the README short and
self-contained, and nothing a user's clone ships points outside it."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _generator():
  spec = importlib.util.spec_from_file_location(
    "generate_configuration", DOCS / "generate_configuration.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_configuration_reference_is_current():
  """docs/configuration.md is what docs/generate_configuration.py makes of today's base_config."""
  expected = _generator().render()
  written = (DOCS / "configuration.md").read_text(encoding="utf-8")
  assert written == expected, (
    "docs/configuration.md is stale: run python docs/generate_configuration.py --write"
  )


def test_configuration_reference_lists_every_key_with_its_meaning():
  from md4jax import config as config_lib  # pylint: disable=import-outside-toplevel

  generator = _generator()
  comments, _, _ = generator.parse_base_config(config_lib.base_config)
  keys = [
    key
    for key, value in generator._flatten(config_lib.base_config(), {})  # pylint: disable=protected-access
    if value is not None
  ]
  assert keys
  undocumented = [key for key in keys if not comments.get(key)]
  assert not undocumented, (
    f"base_config sets {undocumented} without a trailing '# meaning' comment on the line"
  )
  text = generator.render()
  assert all(f"| `{key}` |" in text for key in keys)


def test_readme_is_at_most_200_lines():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details to docs/"


def test_readme_keeps_the_commands_ci_runs():
  """.ci/run installs and tests exactly as the README's quick start says."""
  text = README.read_text(encoding="utf-8")
  assert 'pip install -e ".[test,tpu]"' in text
  assert "python -m pytest -q tests" in text


@pytest.mark.parametrize("where", ["README.md", "docs", "md4jax", "benchmarks"])
def test_nothing_points_outside_the_repository(where):
  """A user's clone has no ../shared: no file it ships may refer to one."""
  path = ROOT / where
  files = (
    [path]
    if path.is_file()
    else sorted(
      p for p in path.rglob("*") if p.is_file() and p.suffix in (".md", ".py", ".txt", ".json")
    )
  )
  offending = [
    f"{p.relative_to(ROOT)}:{number}"
    for p in files
    for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
    if re.search(r"\.\./shared|shared/docs", line)
  ]
  assert not offending, f"references into ../shared: {offending}"


# Pages linked before they land (written in the same change by someone else): drop each name once
# its file is in the repository.
PENDING_PAGES = set()


def test_relative_links_resolve():
  """Every relative Markdown link in README.md and docs/*.md names a file of the repository."""
  broken = []
  for page in [README, *sorted(DOCS.glob("*.md"))]:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      path = (page.parent / target.split("#")[0]).resolve()
      if not path.exists() and str(path.relative_to(ROOT)) not in PENDING_PAGES:
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert not broken, f"broken links: {broken}"
