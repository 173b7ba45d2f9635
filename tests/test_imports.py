"""The package's import arrows run one way: subpackages are layers, and no module imports itself
through others."""

import ast
import os
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "md4jax"

# What each subpackage may import from md4jax, besides itself. The library (LIBRARY) is the
# diffusion math, the network, data, training, sampling and evaluation: the diffusion math and
# the network know nothing of each other, of data or of training; the trainer knows nothing of
# evaluation. Above the library: the config tree (whose validators call the library's own
# checks), the configs, and the application layer (workdirs, md4jax.load, the CLI's modes, the
# harness, reports and plots).
ALLOWED = {
  "diffusion": set(),
  "model": set(),
  "data": {"diffusion", "rng"},
  "runtime": {"data"},
  "training": {"diffusion", "model", "runtime"},
  "sampling": {"diffusion", "training", "runtime"},
  "evaluation": {"diffusion", "model", "data", "sampling", "training", "runtime", "rng"},
  # Post-training: rollouts (sampling), policy updates (training's state and step pieces).
  "posttraining": {"diffusion", "model", "data", "sampling", "training", "runtime", "rng"},
  "config": {"diffusion", "model", "sampling", "evaluation", "posttraining", "runtime"},
  "configs": {"config"},
  "app": {
    "diffusion",
    "model",
    "data",
    "sampling",
    "training",
    "evaluation",
    "posttraining",
    "runtime",
    "config",
    "rng",
  },
}
LIBRARY = {"diffusion", "model", "data", "training", "sampling", "evaluation", "posttraining"}
ENTRY_POINTS = {"main", "aot", "convert", "lm_eval"}
# Top-level modules that import nothing of md4jax, so any layer may be allowed to import them.
LEAVES = {"rng", "user_errors"}
# The samplers over any denoiser: only the diffusion math beneath them.
DENOISER_GENERIC = {
  "sampling.samplers",
  "sampling.steps",
  "sampling.unmasking",
  "sampling.remasking",
  "sampling.categorical",
  "sampling.decoder",
  "sampling.blocks",
  "sampling.arguments",
  "sampling.trajectory",
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
  """Module -> the md4jax modules it imports, as dotted names below md4jax ("" is md4jax)."""
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  edges = {m: set() for m in modules}
  for module, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("md4jax"):
        continue
      base = node.module[len("md4jax.") :] if node.module != "md4jax" else ""
      for alias in node.names:
        name = f"{base}.{alias.name}" if base else alias.name
        edges[module].add(name if name in modules else base)
  return edges


def _top(module: str) -> str:
  return module.split(".")[0]


def test_no_import_circles():
  edges, order, state = _imports(), [], {}

  def visit(module, path):
    if state.get(module) == "done":
      return
    assert state.get(module) != "open", f"import circle: {' -> '.join(path + [module])}"
    state[module] = "open"
    for imported in sorted(edges[module]):
      visit(imported, path + [module])
    state[module] = "done"
    order.append(module)

  for module in sorted(edges):
    visit(module, [])
  assert len(order) == len(edges) > 30


def test_subpackages_are_layers():
  edges = _imports()
  packages = {_top(m) for m in edges if "." in m}
  assert packages == set(ALLOWED), "a new subpackage needs its import rule here"
  top_level = {m for m in edges if "." not in m and m and m not in ALLOWED}
  assert top_level == ENTRY_POINTS | LEAVES, "a new top-level module needs its rule here"
  for module, imported in edges.items():
    if "." not in module:
      continue  # The entry points may import anything; the leaves: below.
    for target in imported:
      assert _top(target) not in ENTRY_POINTS, f"{module} imports the entry point {target}"
      if _top(target) != _top(module):
        assert _top(target) in ALLOWED[_top(module)], f"{module} may not import {target}"


def test_the_library_imports_no_config_and_no_workdir_code():
  edges = _imports()
  for module, imported in edges.items():
    if _top(module) in LIBRARY:
      above = {
        t for t in imported if _top(t) in ("config", "configs", "app") or t == "runtime.workdir"
      }
      assert not above, f"{module} imports {above}: the library reads no config and no workdir"


def test_leaves_import_nothing_of_md4jax():
  edges = _imports()
  for module in LEAVES:
    assert not edges[module], f"{module} imports {edges[module]}"


def test_samplers_need_only_the_diffusion_math():
  edges = _imports()
  for module in DENOISER_GENERIC:
    outside = {t for t in edges[module] if _top(t) not in ("diffusion", "sampling")}
    assert not outside, f"{module} imports {outside}"


def test_the_objective_and_state_know_nothing_of_the_loop_or_evaluation():
  edges = _imports()
  for module in ("training.objective", "training.state"):
    assert not {"training.train", "modes"} & edges[module]
    assert not {_top(t) for t in edges[module]} & {"evaluation", "sampling"}


def test_the_public_api_loads_no_data_checkpoint_or_plot_library():
  script = (
    "import sys, md4jax\n"
    "print(sorted(name for name in md4jax.__all__ if not hasattr(md4jax, name)))\n"
    "print(sorted(m for m in ('grain', 'tensorflow_datasets', 'tensorflow', 'matplotlib',"
    " 'orbax', 'orbax.checkpoint') if m in sys.modules))\n"
  )
  result = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    check=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.stdout.split("\n")[:2] == ["[]", "[]"], result.stdout
  assert {"nelbo", "sample", "get_schedule", "Transformer", "MarkovLanguage"} <= set(
    __import__("md4jax").__all__
  )


def test_the_programs_import_together():
  # The suite imports these in one process (test_aot, test_convert, test_harness):
  # their module-level flags must not collide. (main is only run as a program.)
  programs = ("aot", "convert", "lm_eval")
  script = "".join(f"import md4jax.{name}\n" for name in programs) + "print('ok')\n"
  result = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.stdout.strip() == "ok", result.stderr[-2000:]
