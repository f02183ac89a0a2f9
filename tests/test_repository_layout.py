"""The tree a newcomer reads (docs/design.md §3): one concern a file, no import cycles, every
document a file names is in the repository, and the repository stays small."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set) -> set:
    """The repository's modules this file imports (relative imports resolved; `from pkg
    import name` counts as an import of pkg.name where that is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycle_anywhere():
    files = [p for p in _tracked() if p.suffix == ".py" and p.exists()]
    modules = {_module_name(p): p for p in files}
    graph = {name: _imports(path, set(modules)) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is how a package is made; the
    # submodules importing the package back would be a cycle, and is caught.
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name and t.startswith(name + "."))
                       or not (ROOT / Path(*name.split("."))).is_dir()}
    visiting, done, cycles = set(), set(), []

    def visit(node, trail):
        if node in done:
            return
        if node in visiting:
            cycles.append(trail[trail.index(node):] + [node])
            return
        visiting.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [nxt])
        visiting.discard(node)
        done.add(node)

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_modules_stay_small():
    too_long = {}
    for path in _tracked():
        limit = {"pnm_kernels": 500, "csrc": 600}.get(path.relative_to(ROOT).parts[0])
        if limit and path.suffix in (".py", ".h", ".cpp", ".cu") and path.exists():
            lines = len(path.read_text().splitlines())
            if lines > limit:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"split these by concern: {too_long}"


# Tables the benchmarks write (into an output folder), not documents of the repository.
GENERATED = re.compile(r"(^|/)(bench_step-[\w-]+|chunk_sweep|noisy_labels)\.md$")


def test_every_markdown_document_a_file_names_exists():
    named = re.compile(r"[\w./-]*\w\.md\b")
    missing = set()
    for path in _tracked():
        if path.suffix not in (".py", ".md", ".h", ".cpp", ".cu", ".sh", ".in", ".txt", ""):
            continue
        if not path.exists() or path.stat().st_size > 1_000_000:
            continue
        text = path.read_text(errors="replace")
        for ref in set(named.findall(text)):
            if "://" in ref or ref.startswith(("http", "www")) or GENERATED.search(ref):
                continue
            ref_path = ref.lstrip("./")
            candidates = [path.parent / ref, ROOT / ref_path]
            if not any(c.exists() for c in candidates):
                missing.add(f"{path.relative_to(ROOT)} names {ref}")
    assert not missing, "\n".join(sorted(missing))


# Files of other projects the design names (apex's, bitsandbytes'), not of this repository.
OTHER_PROJECTS = {"csrc/multi_tensor_adam.cu", "tests/test_optim.py"}


def test_every_repository_file_a_document_names_exists_or_is_found_at_its_commit():
    """A file a document names (a script, a log, a source) is in the tree; one no longer in
    it is named with the commit that holds it ("... at commit 1808025"), and is there."""
    named = re.compile(r"\b((?:benchmarks|tests|pnm_kernels|csrc|docs)/[\w./-]*\w"
                       r"\.(?:py|sh|log|txt|json|cpp|h|cu|cuh|png|md))\b")
    at_commit = re.compile(r"\bcommit `?([0-9a-f]{7,40})\b")
    wrong = []
    for path in _tracked():
        if path.suffix not in (".md", ".py", ".sh", ".cpp", ".h", ".cu") or not path.exists():
            continue
        text = path.read_text(errors="replace")
        for match in named.finditer(text):
            ref = match.group(1)
            if (ROOT / ref).exists() or ref in OTHER_PROJECTS or GENERATED.search(ref):
                continue
            commit = at_commit.search(text, match.end(), match.end() + 200)
            found = commit is not None and subprocess.run(
                ["git", "cat-file", "-e", f"{commit.group(1)}:{ref}"], cwd=ROOT,
                capture_output=True).returncode == 0
            if not found:
                wrong.append(f"{path.relative_to(ROOT)} names {ref}")
    assert not wrong, "\n".join(sorted(wrong))


def _section_anchors(markdown: str) -> set:
    """The anchors GitHub gives a document's headings (outside code blocks)."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+\s+(.*)$", prose, re.M)}


def test_every_link_to_a_section_names_a_heading_of_its_document():
    """A heading renamed or moved to another document leaves no link pointing nowhere."""
    documents = [p for p in _tracked() if p.suffix == ".md" and p.exists()]
    anchors = {p.resolve(): _section_anchors(p.read_text()) for p in documents}
    broken = []
    for path in documents:
        for target, section in re.findall(r"\]\(([^)\s#]*)#([\w-]+)\)", path.read_text()):
            if target and not target.endswith(".md"):
                continue
            document = (path.parent / target).resolve() if target else path.resolve()
            if section not in anchors.get(document, set()):
                broken.append(f"{path.relative_to(ROOT)}: {target}#{section}")
    assert not broken, "\n".join(broken)


def test_the_tracked_files_total_at_most_3_mb():
    total = sum(p.stat().st_size for p in _tracked() if p.exists())
    assert total <= 3 * 1024 * 1024, f"{total / 2**20:.1f} MiB tracked"
