"""scripts/notebook_urls.py: the notebooks' Colab badges and clone URLs follow pyproject.toml's
[project.urls] Repository."""

from __future__ import annotations

import json

import pytest

from tests.helpers.repo_files import REPO_ROOT, load_file

notebook_urls = load_file("scripts/notebook_urls.py")
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def _cells_text(path):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_badge_and_clone_url_match_the_metadata(path):
    repo = notebook_urls.repository_url()
    name = path.relative_to(REPO_ROOT).as_posix()
    cells = _cells_text(path)
    expected = (
        f"https://colab.research.google.com/github/{repo.removeprefix('https://github.com/')}"
    )
    assert notebook_urls.badge(repo, name) in cells[0]
    assert f"({expected}/blob/main/{name})" in cells[0]
    assert sum(f'REPO_URL = "{repo}.git"' in text for text in cells) == 1
    text = path.read_text()
    assert notebook_urls._dump(notebook_urls.synced(json.loads(text), repo, name)) == text


def test_a_new_url_rewrites_the_badge_and_the_clone_url_once():
    path = NOTEBOOKS[0]
    nb = json.loads(path.read_text())
    for _ in range(2):  # idempotent: a second sync changes nothing
        nb = notebook_urls.synced(nb, "https://github.com/someone/fork", "notebooks/x.ipynb")
    title = "".join(nb["cells"][0]["source"])
    assert title.count("Open In Colab") == 1
    assert "github/someone/fork/blob/main/notebooks/x.ipynb)" in title
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert sum('REPO_URL = "https://github.com/someone/fork.git"' in c for c in code) == 1


def test_urls_that_colab_cannot_open_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not https://github.com/OWNER/NAME"):
        notebook_urls.colab_url("https://gitlab.com/a/b", "notebooks/x.ipynb")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n')
    with pytest.raises(KeyError, match=r"\[project.urls\] has no \"Repository\""):
        notebook_urls.repository_url(pyproject)
    assert notebook_urls.clone_url("https://github.com/a/b.git") == "https://github.com/a/b.git"
