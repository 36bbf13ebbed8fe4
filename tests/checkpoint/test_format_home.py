"""The checkpoint format has one home (checkpoint/format.py) that training builds on, not the other way round."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parents[2] / "megatron_lite"


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_the_checkpoint_package_imports_nothing_from_training():
    offenders = {str(p.relative_to(PACKAGE)): m for p in (PACKAGE / "checkpoint").glob("*.py")
                 for m in _imports(p) if m.startswith("megatron_lite.training")}
    assert offenders == {}


def test_file_names_tags_and_metadata_are_defined_once():
    """The names a checkpoint's files carry appear as literals only in format.py and
    deepspeed_compat/checkpoint_files.py."""
    literals = ("megatron_lite.json", '"latest"', "rng_rank_", "model_states.pt", "optim_states.pt", '"iter_')
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "format.py" or path.relative_to(PACKAGE).as_posix() == "deepspeed_compat/checkpoint_files.py":
            continue
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", "`")))
        body = ast.get_docstring(ast.parse(path.read_text())) or ""
        hits = [lit for lit in literals if lit in text.replace(body, "")]
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    assert found == {}
