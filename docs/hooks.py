"""MkDocs hooks: README.md becomes the site's home page and BENCHMARKS.md its
``benchmarks.md``, each with its links rewritten from the repository's layout to the
site's (``docs/x.md`` -> ``x.md``; from a page under docs/, ``../README.md`` ->
``index.md`` and ``../BENCHMARKS.md`` -> ``benchmarks.md``), so that the same Markdown
reads right on GitHub and on the site."""

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = {"index.md": "README.md", "benchmarks.md": "BENCHMARKS.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def site_link(target: str, page: str) -> str:
    """A link's target as the site sees it, from the page at ``page`` (docs-relative)."""
    if page in PUBLISHED:  # written from the repository's root
        if target.startswith("docs/"):
            return target[len("docs/"):]
        return {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md"}.get(target, target)
    depth = page.count("/")
    up = "../" * (depth + 1)
    for source, published in (("README.md", "index.md"), ("BENCHMARKS.md", "benchmarks.md")):
        if target == up + source:
            return "../" * depth + published
    return target


def on_files(files, config):
    for name, source in PUBLISHED.items():
        with open(os.path.join(ROOT, source)) as f:
            files.append(File.generated(config, name, content=f.read()))
    return files


def on_page_markdown(markdown, page, config, files):
    here = page.file.src_uri
    return LINK.sub(lambda m: f"]({site_link(m[1], here)}{m[2] or ''})", markdown)
