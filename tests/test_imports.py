"""The package's import arrows run one way: no module imports itself through others."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "md4jax"


def _imports() -> dict[str, set[str]]:
  modules = {p.stem for p in PACKAGE.glob("*.py")}
  edges = {m: set() for m in modules}
  for module in modules:
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "md4jax":
        edges[module] |= {alias.name for alias in node.names} & modules
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("md4jax."):
        edges[module].add(node.module.split(".")[1])
  return edges


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
  assert len(order) == len(edges) > 20
  # The layers the reshape set up: the objective and the state know nothing of training or modes.
  assert not {"train", "modes", "evaluate"} & edges["objective"]
  assert not {"train", "modes", "evaluate"} & edges["state"]
  assert "train" not in edges["evaluate"]
