"""MkDocs hook: the site's front page is the README (one text, read on GitHub and on the site).

`index.md` holds one line; this hook replaces it with README.md, its links into `docs/` made
relative to the site's pages (`docs/running.md` -> `running.md`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- the README is the front page: docs/hooks.py -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text()
    return re.sub(r"\]\(docs/", "](", text)
