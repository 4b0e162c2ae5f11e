"""MkDocs hooks: the README is the site's home page, and links keep working.

Pages are written to be read on a repository browser too, so their links are relative to
the file's place in the repository: the README links `docs/audit.md`, a page links
`../examples/figures/prenorm_loss.png`. In the site:

- the README becomes `index.md`, and a link to it from a page leads there;
- a file of the repository outside `docs/` that a page links to (a figure,
  `benchmarks/README.md`, `tests/zoo/TABLE.md`) is published under `repo/` (a markdown
  file as a page, whose own links are followed the same way);
- every relative link is rewritten to where its target lands in the site.

A link whose target does not exist is left as written, so `mkdocs build --strict` fails
on it.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
# an inline code span (left alone) or a link / image target: ](target) or ](target "title")
LINK = re.compile(r"(`+)[^`]*?\1|(\]\()([^)\s#]+)((?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\))")
PUBLISHED = "repo"

_root: Path
_docs: Path
_site_path: dict[Path, str] = {}   # real file -> its path in the site


def _relative_targets(markdown: str):
    """(match, target) for every relative link outside code in `markdown`."""
    pos = 0
    for fence in [*FENCE.finditer(markdown), None]:
        end = fence.start() if fence else len(markdown)
        for m in LINK.finditer(markdown, pos, end):
            target = m.group(3)
            if target and "://" not in target and not target.startswith(("/", "mailto:")):
                yield m, target
        pos = fence.end() if fence else len(markdown)


def _resolve(source: Path, target: str) -> Path:
    return Path(os.path.normpath(source.parent / target))


def on_files(files: Files, config) -> Files:
    global _root, _docs
    _root = Path(config.config_file_path).resolve().parent
    _docs = Path(config.docs_dir).resolve()
    _site_path.clear()
    readme = _root / "README.md"
    files.append(File.generated(config, "index.md", abs_src_path=str(readme)))
    _site_path[readme] = "index.md"
    pages = [readme] + [Path(f.abs_src_path).resolve() for f in files.documentation_pages()
                        if f.abs_src_path and f.src_uri != "index.md"]
    for page in pages:
        if page.is_relative_to(_docs):
            _site_path[page] = page.relative_to(_docs).as_posix()
    while pages:
        page = pages.pop()
        for _, target in _relative_targets(page.read_text(encoding="utf-8")):
            path = _resolve(page, target)
            if path in _site_path or not path.is_file() or not path.is_relative_to(_root):
                continue
            if path.is_relative_to(_docs):
                continue   # a file of docs/: mkdocs knows it already
            uri = f"{PUBLISHED}/{path.relative_to(_root).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(path)))
            _site_path[path] = uri
            if path.suffix == ".md":
                pages.append(path)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = Path(page.file.abs_src_path).resolve()
    here = posixpath.dirname(page.file.src_uri)
    out, pos = [], 0
    for m, target in _relative_targets(markdown):
        path = _resolve(source, target)
        uri = _site_path.get(path)
        if uri is None and path.is_relative_to(_docs):
            uri = path.relative_to(_docs).as_posix()
        if uri is None:
            continue   # not found: left as written, and mkdocs reports it
        out.append(markdown[pos:m.start(3)] + posixpath.relpath(uri, here or "."))
        pos = m.end(3)
    out.append(markdown[pos:])
    return "".join(out)
