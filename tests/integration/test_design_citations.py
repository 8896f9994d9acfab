"""Comments cite what the repository has: its files, docs/ sections and design decisions.

Code comments cite design decisions (docs/design.rst, decision 5), docs sections by title
(docs/opt_levels.rst, "Models that arrive in half precision") and the files that hold a thing
(``csrc/common/adam_math.h``, ``reference/_optim.py``). A citation of a document that is not
in the repository, of a decision number the page does not have, of a section title no page has,
or of a file that was renamed sends the reader nowhere.
"""

from __future__ import annotations

import ast
import io
import itertools
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.rst"
SCANNED = ["packages", "benchmarks", "tests", "examples", "docs", ".ci"]
SUFFIXES = {".py", ".md", ".rst", ".cpp", ".cu", ".h", ".cuh", ".toml"}
# A citation of a document outside the repository (the old forms of these references).
_OUTSIDE = re.compile(
    r"DESIGN(?:\.md| decision)|\bGPU\.md\b|\bSTYLE(?:\.md| habit| \d)|\bstyle (?:document|guide)\b"
    r"|\bhouse[- ]style\b"
)
_CITATION = re.compile(r"docs/design\.rst,?\s+decisions?\s+(\d+)")

_CPP_SUFFIXES = {".h", ".cuh", ".cu", ".cpp"}
# A file or folder named in a comment: ``foo/bar.py``, ``_x.py``, ``csrc/cuda``, ``adam_math.h``.
_PATH = re.compile(
    r"(?<![\w/.\-}])"
    r"(?:(?:[\w.\-]+/)*[\w*\-][\w.*\-]*\.(?:py|h|hpp|cuh|cu|cpp|rst|md|toml)(?![\w\-])"
    r"|csrc(?:/[\w.\-]+)*)"
)
# A docs section cited by title: docs/opt_levels.rst, "Models that arrive in half precision".
_SECTION = re.compile(r"(docs/[\w/\-]+\.rst)`*,?\s*\(?\"([^\"]+)\"")
# Names of files that are not this repository's, each with the reason it is named.
NOT_REPOSITORY_FILES: dict[str, str] = {
    # Apex's sources (github.com/NVIDIA/apex), where a comment says what follows them.
    "apex/__init__.py": "Apex's package, which the apex alias stands in for",
    "apex/amp/frontend.py": "Apex's opt-level presets",
    "apex/optimizers/fp16_optimizer.py": "Apex's cut-down FP16_Optimizer",
    "csrc/amp_C_frontend.cpp": "Apex's amp_C bindings, whose signatures amp_C keeps",
    "csrc/multi_tensor_adam.cu": "Apex's Adam kernel",
    "csrc/multi_tensor_lamb.cu": "Apex's LAMB kernel",
    "csrc/multi_tensor_lamb_mp.cu": "Apex's mixed-precision LAMB kernel",
    "csrc/multi_tensor_lamb_stage_1.cu": "Apex's LAMB stage kernels",
    "csrc/multi_tensor_lamb_stage_2.cu": "Apex's LAMB stage kernels",
    "csrc/multi_tensor_novograd.cu": "Apex's NovoGrad kernel",
    "csrc/update_scale_hysteresis.cu": "Apex's scale update with hysteresis",
    # PyTorch's and CUDA's own files.
    "aten/src/ATen/native/cuda/fused_adam_utils.cuh": "PyTorch's fused Adam math",
    "ATen/ATen.h": "PyTorch's umbrella header, which the kernels no longer include",
    "ATen/core/Tensor.h": "PyTorch's tensor header, which csrc/common/aten_headers.h includes",
    "ATen/cuda/CUDAContext.h": "PyTorch's header that the emulation's copy stands in for",
    "c10/cuda/CUDAException.h": "PyTorch's header that the emulation's copy stands in for",
    "c10/cuda/CUDAGuard.h": "PyTorch's header that the emulation's copy stands in for",
    "c10/cuda/CUDAStream.h": "PyTorch's header that the emulation's copy stands in for",
    "include/cuda_runtime.h": "a file of a CUDA toolkit installation",
    "cusparse.h": "a file of a CUDA toolkit installation",
    # Files of the user's.
    "train.py": "the user's training script",
}


def _text_files() -> list[Path]:
    files = [ROOT / "noxfile.py", ROOT / "README.md"]
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*"):
            if "_build" in path.parts or path == Path(__file__).resolve():
                continue
            if path.is_file() and path.suffix in SUFFIXES:
                files.append(path)
    return files


def _source_files() -> list[Path]:
    """The files whose comments must cite what exists: the C++/CUDA sources, the packages'
    Python sources, noxfile.py and what CI runs."""
    files = [ROOT / "noxfile.py", ROOT / ".ci" / "run", *sorted((ROOT / ".ci").glob("*.py"))]
    for package in sorted((ROOT / "packages").iterdir()):
        files += sorted(p for p in (package / "src").rglob("*.py"))
        files += sorted(p for p in (package / "csrc").rglob("*") if p.suffix in _CPP_SUFFIXES)
    return files


def _join(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Runs of comment lines on consecutive source lines, as (first line, text) blocks."""
    blocks: list[tuple[int, str]] = []
    last = -2
    for number, text in lines:
        if blocks and number == last + 1:
            blocks[-1] = (blocks[-1][0], f"{blocks[-1][1]}\n{text}")
        else:
            blocks.append((number, text))
        last = number
    return blocks


def _cpp_comments(text: str) -> list[tuple[int, str]]:
    lines: list[tuple[int, str]] = []
    blocks: list[tuple[int, str]] = []
    token = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)
    for match in token.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        if match.group().startswith("//"):
            lines.append((number, match.group()[2:]))
        elif match.group().startswith("/*"):
            body = match.group()[2:-2]
            blocks.append((number, "\n".join(line.strip(" *") for line in body.splitlines())))
    return _join(lines) + blocks


def _python_comments(text: str) -> list[tuple[int, str]]:
    lines = [
        (tok.start[0], tok.string[1:])
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    docstrings: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstring = first.value.value
                if isinstance(docstring, str):
                    docstrings.append((first.lineno, docstring))
    return _join(lines) + docstrings


def _comments(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of one source file: (first line, text with its newlines)."""
    text = path.read_text()
    if path.suffix in _CPP_SUFFIXES:
        found = _cpp_comments(text)
    elif path.suffix == ".py":
        found = _python_comments(text)
    else:  # a shell script
        found = _join(
            [
                (n, line.split("#", 1)[1])
                for n, line in enumerate(text.splitlines(), 1)
                if line.lstrip().startswith("#")
            ]
        )
    return found


def _cited(pattern: re.Pattern[str]) -> list[tuple[Path, int, re.Match[str]]]:
    """Every match of ``pattern`` in the comments of the sources, with its file and line."""
    return [
        (path, first + comment.count("\n", 0, match.start()), match)
        for path in _source_files()
        for first, comment in _comments(path)
        for match in pattern.finditer(comment)
    ]


def _resolves(name: str, source: Path) -> bool:
    """Whether ``name`` is a file or folder relative to the repository, the folder of
    ``source``, the package of ``source`` (its folder, or its import package: ``csrc/cuda``,
    ``reference/_optim.py``), or any package's ``src`` (import paths: ``amp_core/_scaler.py``)."""
    bases = [ROOT, source.parent, *(ROOT / "packages").glob("*/src")]
    if source.is_relative_to(ROOT / "packages"):
        package = ROOT / "packages" / source.relative_to(ROOT / "packages").parts[0]
        bases += [package, *(package / "src").glob("*")]
    return any(any(base.glob(name)) if "*" in name else (base / name).exists() for base in bases)


def _section_titles(page: Path) -> set[str]:
    """The titles of the sections of an .rst page (text lines underlined by =, -, ~, ^ ...)."""
    lines = page.read_text().splitlines()
    return {
        _plain(title)
        for title, under in itertools.pairwise(lines)
        if title.strip()
        and re.fullmatch(r"([=\-~^\"'`*+#])\1+", under.strip())
        and len(under.strip()) >= len(title.strip())
    }


def _plain(title: str) -> str:
    return " ".join(title.replace("``", "").split()).lower()


def _decision_numbers() -> set[int]:
    """The numbers of the decisions docs/design.rst lists (``N. **Title**`` items)."""
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", DESIGN.read_text(), re.MULTILINE)}


def test_design_page_numbers_its_decisions_one_to_thirteen() -> None:
    assert _decision_numbers() == set(range(1, 14))


def test_no_citation_of_a_document_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert not found, "cite docs/ pages (e.g. 'docs/design.rst, decision 5'):\n" + "\n".join(found)


def test_every_cited_decision_exists() -> None:
    numbers = _decision_numbers()
    cited = [
        (path, int(match.group(1)))
        for path in _text_files()
        for match in _CITATION.finditer(path.read_text(errors="replace"))
    ]
    assert cited, "expected code to cite docs/design.rst by decision number"
    missing = [f"{path.relative_to(ROOT)}: decision {n}" for path, n in cited if n not in numbers]
    assert not missing, f"citations of decisions docs/design.rst does not have: {missing}"


def test_every_file_named_in_a_comment_exists() -> None:
    named = [(path, number, match.group().rstrip(".")) for path, number, match in _cited(_PATH)]
    assert len(named) > 100, f"expected the sources to name their files, found {len(named)}"
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {name}"
        for path, number, name in named
        if name not in NOT_REPOSITORY_FILES and not _resolves(name, path)
    ]
    assert not missing, (
        "comments name files that are not in the repository (name the file that holds the "
        "thing today, or add a name that is not the repository's to NOT_REPOSITORY_FILES with "
        "the reason):\n" + "\n".join(missing)
    )


def test_names_of_files_outside_the_repository_are_named_and_not_ours() -> None:
    named = {match.group().rstrip(".") for _, _, match in _cited(_PATH)}
    unused = sorted(set(NOT_REPOSITORY_FILES) - named)
    assert not unused, f"NOT_REPOSITORY_FILES lists names no comment has any more: {unused}"
    ours = [name for name in NOT_REPOSITORY_FILES if (ROOT / name).exists()]
    assert not ours, f"these are repository files, cite them as such: {ours}"


def test_every_cited_docs_section_exists() -> None:
    cited = [(path, number, match[1], match[2]) for path, number, match in _cited(_SECTION)]
    assert cited, "expected the sources to cite docs sections by title"
    missing = [
        f'{path.relative_to(ROOT)}:{number}: {page}, "{_plain(title)}"'
        for path, number, page, title in cited
        if not (ROOT / page).is_file() or _plain(title) not in _section_titles(ROOT / page)
    ]
    assert not missing, "comments cite docs sections that do not exist:\n" + "\n".join(missing)
