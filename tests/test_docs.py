"""The manual in docs/ builds with every link and anchor valid, and the README stays a front door."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    # mkdocs.yml turns unknown links, missing anchors and pages left out of the nav into warnings,
    # and --strict makes any warning fail the build.
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_readme_is_short_and_links_existing_pages():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links, "the README links the manual's pages"
    assert [link for link in links if not (REPO / link).is_file()] == []
