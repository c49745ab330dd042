"""The repository stands alone: the README, docs and docstrings name only files that are in it."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("overlap", "collectives", "microbatch", "launch", "tests", "docs", ".ci")
_LINK = re.compile(r"\]\(([^)\s]+)\)")  # markdown link targets
_REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\.(?:py|md|png|toml|json|csv))" %
                        "|".join(re.escape(p) for p in PACKAGES))
_MD_NAME = re.compile(r"(?<![\w./-])([\w./-]+\.md)\b")


def _texts():
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "pyproject.toml")]
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    files += glob.glob(os.path.join(ROOT, ".ci", "*"))
    for pkg in PACKAGES[:5]:
        files += glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)
    for path in sorted(files):
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), f.read()


def _exists(name, where):
    """``name`` relative to the file that names it, or to the repository root."""
    name = name.split("#", 1)[0]
    return any(os.path.exists(os.path.join(base, name)) for base in (os.path.dirname(os.path.join(ROOT, where)), ROOT))


def _dangling(texts):
    """Every name in ``texts`` ((file, text) pairs) of a file that is not in the repository."""
    missing = []
    md_files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)}
    for where, text in texts:
        for target in (_LINK.findall(text) if where.endswith(".md") else ()):
            if not re.match(r"[a-z]+://|#|mailto:", target) and not _exists(target, where):
                missing.append(f"{where}: link to {target}")
        for name in _REPO_PATH.findall(text):
            if not _exists(name, where):
                missing.append(f"{where}: names {name}")
        for name in _MD_NAME.findall(text):
            if os.path.basename(name) not in md_files:
                missing.append(f"{where}: names {name}")
        if "../shared" in text:
            missing.append(f"{where}: names ../shared, which is outside the repository")
    return missing


def test_links_and_file_names_point_inside_the_repository():
    missing = _dangling((where, text) for where, text in _texts() if where != "tests/test_docs.py")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("bad", ["see [the design](DESIGN.md)", "facts in `../shared/reference/npu-api.md`",
                                 "run `launch/nothing_here.py`"])
def test_the_check_catches_a_dangling_name(bad):
    assert _dangling([("README.md", bad)])
    assert not _dangling([("README.md", "see [the pipeline](docs/pipeline.md) and `launch/prefill.py`")])
