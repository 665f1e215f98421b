"""MkDocs hook (mkdocs.yml `hooks:`): what the site takes from outside docs/, and the generated settings table.

- deploy/kubernetes/README.md, benchmarks/README.md and everything under benchmarks/results/ join the site at their
  repository paths, so the Kubernetes and benchmarks pages link to them (and show the plots) without copies.
  In docs/*.md those links are written `../deploy/...` / `../benchmarks/...`, which work on GitHub; this hook
  rewrites them to the site's paths before MkDocs checks them (`mkdocs build --strict`: a broken one fails).
- docs/configuration.md's `<!-- settings-reference -->` marker becomes the table of every settings field, made
  by docs/settings_reference.py with the project's Python (TRITONLLM_PYTHON, default .venv/bin/python: the
  docs venv has only MkDocs, not the frontend's dependencies).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
EXTERNAL = ("deploy/kubernetes/README.md", "benchmarks/README.md")
EXTERNAL_TREES = ("benchmarks/results",)
MARKER = "<!-- settings-reference -->"
_REPO_LINK = re.compile(r"\]\(\.\./((?:deploy/kubernetes|benchmarks)/[^)\s]*)\)")


def on_files(files, config):
    paths = list(EXTERNAL)
    for tree in EXTERNAL_TREES:
        paths += sorted(str(p.relative_to(ROOT)) for p in (ROOT / tree).rglob("*") if p.is_file())
    for path in paths:
        files.append(File(path, src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def _settings_table() -> str:
    python = os.environ.get("TRITONLLM_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    result = subprocess.run([python, str(ROOT / "docs" / "settings_reference.py")], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"docs/settings_reference.py failed ({python}):\n{result.stderr}")
    return result.stdout


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith(("deploy/", "benchmarks/")):
        return markdown
    markdown = _REPO_LINK.sub(lambda m: "](" + m.group(1) + ")", markdown)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _settings_table())
    return markdown
