"""The notebooks' "Open in Colab" badges and clone URLs, written from the package metadata.

The one place the repository's URL is typed is pyproject.toml's `[project.urls] Repository`
(a GitHub URL). From it this script writes, in every notebooks/*.ipynb:

- the badge under the title: Colab's `colab.research.google.com/github/OWNER/NAME/blob/BRANCH/
  notebooks/FILE.ipynb` link, which opens the notebook from that repository;
- the setup cell's `REPO_URL = "..."` line: the clone URL (the Repository URL with `.git`).

After changing the URL (a fork, a mirror) run `python scripts/notebook_urls.py`; with `--check`
it only reports notebooks that differ (tests/unit/scripts/test_notebook_urls.py does the same).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BRANCH = "main"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_PREFIX = "[![Open In Colab]"
REPO_URL_LINE = re.compile(r'^REPO_URL = "[^"]*"(.*)$', re.MULTILINE)
_GITHUB = re.compile(r"^https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?$")


def repository_url(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """`[project.urls] Repository` of a pyproject.toml."""
    with pyproject.open("rb") as f:
        urls = tomllib.load(f).get("project", {}).get("urls", {})
    if "Repository" not in urls:
        raise KeyError(f'{pyproject}: [project.urls] has no "Repository" URL; add one')
    return urls["Repository"]


def _owner_name(repo_url: str) -> tuple[str, str]:
    match = _GITHUB.match(repo_url)
    if not match:
        raise ValueError(
            f"Repository URL {repo_url!r} is not https://github.com/OWNER/NAME: Colab opens "
            "notebooks from GitHub only"
        )
    return match.group(1), match.group(2)


def colab_url(repo_url: str, notebook: str, branch: str = BRANCH) -> str:
    """Colab's link that opens `notebook` (a path in the repository) from `repo_url`."""
    owner, name = _owner_name(repo_url)
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{notebook}"


def clone_url(repo_url: str) -> str:
    owner, name = _owner_name(repo_url)
    return f"https://github.com/{owner}/{name}.git"


def badge(repo_url: str, notebook: str) -> str:
    return f"{BADGE_PREFIX}({BADGE_IMAGE})]({colab_url(repo_url, notebook)})"


def _with_badge(source: str, line: str) -> str:
    """A title cell's text with `line` as its badge: replacing one, else after the title."""
    lines = source.split("\n")
    kept = [x for x in lines if not x.startswith(BADGE_PREFIX)]
    if len(kept) < len(lines) and kept[1:2] == [""] and kept[2:3] == [""]:
        del kept[1]  # the blank line that followed the old badge
    return "\n".join([kept[0], "", line, *kept[1:]])


def synced(nb: dict, repo_url: str, notebook: str) -> dict:
    """The notebook `nb` (nbformat JSON) with its badge and REPO_URL from `repo_url`."""
    cells = nb["cells"]
    if not cells or cells[0]["cell_type"] != "markdown":
        raise ValueError(f"{notebook}: the first cell must be the markdown title")
    title = "".join(cells[0]["source"])
    cells[0]["source"] = _split(_with_badge(title, badge(repo_url, notebook)))
    setups = [c for c in cells if c["cell_type"] == "code" and REPO_URL_LINE.search(_text(c))]
    if len(setups) != 1:
        raise ValueError(f"{notebook}: expected one code cell with a REPO_URL line")
    text = REPO_URL_LINE.sub(
        lambda m: f'REPO_URL = "{clone_url(repo_url)}"{m.group(1)}', _text(setups[0])
    )
    setups[0]["source"] = _split(text)
    return nb


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def _split(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="report differences, write nothing")
    args = parser.parse_args(argv)
    repo_url = repository_url()
    stale = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = path.read_text()
        new = _dump(synced(json.loads(text), repo_url, path.relative_to(ROOT).as_posix()))
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {'differs' if args.check else 'updated'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
